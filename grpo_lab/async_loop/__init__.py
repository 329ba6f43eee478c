"""The async LoRA GRPO loop: TRL's AsyncGRPOTrainer -> adapters on shared storage -> router -> replicas -> rollouts.

Modules, one idea each: `tree_attention` (packed-row attention without the Hub kernel), `storage` (atomic, never
reused adapter versions), `rollout_worker` (TRL's worker without vLLM, with pinned group versions and bounded
faults), `control_client` (bounded control calls), `preflight` (early, clear errors), `config` and `trainer`
(`AsyncGRPOLabConfig`, `AsyncGRPOLabTrainer`), `launch` (replicas + router + trainer in one call).
"""

import os

# The loop is built on `trl.experimental.async_grpo` on purpose; TRL's import-time notice about it (a pink block in
# notebook 04's setup cell) says nothing a user can act on. Set before any module here imports trl.experimental.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
