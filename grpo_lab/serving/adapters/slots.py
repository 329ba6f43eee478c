"""How many LoRA adapter slots (`--max-loras`) a replica needs for a trainer's `max_staleness`: stated once.

Every launcher (the vLLM launcher, `LocalCluster`, the async loop), the trainer's preflight, the doctor and
notebook 04 take the number from here, so the margin cannot drift between them again.

- `min_max_loras`: TRL 1.16's own rule, which AsyncGRPOTrainer checks against the server's `/server_info` before
  it syncs adapters (`min_loras = args.max_staleness + 2` in trl/experimental/async_grpo/async_grpo_trainer.py).
  A sample may be consumed up to `max_staleness` versions after the one that generated it, so `max_staleness + 1`
  versions can be named by requests in flight at once; each sync loads the next version before it unloads the
  oldest, so the server briefly holds one more. Preflight refuses a server below it.
- `max_loras_for`: what replicas are started with, one slot more. Behind the router an unloaded adapter keeps its
  slot until the rollouts still using it have finished (`drain`), and TRL loads the next version meanwhile
  (under a pause, which freezes the draining rollouts until its resume), so a replica holds one adapter more than
  TRL counts.
"""

from __future__ import annotations

# TRL 1.16 AsyncGRPOConfig's default `max_staleness` (tests/serving/test_adapter_slots.py checks they agree).
DEFAULT_MAX_STALENESS = 4


def _checked(max_staleness: int) -> int:
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness!r}")
    return max_staleness


def min_max_loras(max_staleness: int) -> int:
    """The fewest adapter slots TRL's AsyncGRPOTrainer accepts for `max_staleness` (`max_staleness + 2`)."""
    return _checked(max_staleness) + 2


def max_loras_for(max_staleness: int) -> int:
    """The `--max-loras` replicas are started with for `max_staleness`: TRL's minimum plus the router's drain slot
    (`max_staleness + 3`)."""
    return min_max_loras(max_staleness) + 1
