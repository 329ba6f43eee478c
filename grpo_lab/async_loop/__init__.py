"""The async LoRA GRPO loop: TRL's AsyncGRPOTrainer -> adapters on shared storage -> router -> replicas -> rollouts.

Modules, one idea each: `tree_attention` (packed-row attention without the Hub kernel), `storage` (atomic, never
reused adapter versions), `rollout_worker` (TRL's worker without vLLM, with pinned group versions and bounded
faults), `control_client` (bounded control calls), `preflight` (early, clear errors), `config` and `trainer`
(`AsyncGRPOLabConfig`, `AsyncGRPOLabTrainer`), `launch` (replicas + router + trainer in one call).
"""

from grpo_lab.lab import environment as _environment

# TRL warns on every import of trl.experimental; this package is built on it on purpose, and the warning is not
# something its users can act on.
_environment.silence_trl_experimental()
