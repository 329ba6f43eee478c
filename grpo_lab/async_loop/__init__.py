"""The async LoRA GRPO loop: TRL's AsyncGRPOTrainer -> adapters on shared storage -> router -> replicas -> rollouts.

Modules, one idea each; the entry points are `trainer` (`AsyncGRPOLabTrainer`), `launch` (replicas + router +
trainer in one call) and `command` (`grpo-lab async-loop`).
"""

from grpo_lab.lab import environment as _environment

# TRL warns on every import of trl.experimental; this package is built on it on purpose, and the warning is not
# something its users can act on.
_environment.silence_trl_experimental()
