"""How many LoRA adapter slots (`--max-loras`) a replica needs for a trainer's `max_staleness`: stated once.

Every launcher, the trainer's preflight, the doctor and notebook 04 take the number from here. TRL 1.16's own rule
(`min_loras = args.max_staleness + 2` in async_grpo_trainer.py): `max_staleness + 1` versions can be named by requests
in flight, and each sync loads the next before it unloads the oldest; the router's `drain` needs one slot more (an
unloaded adapter keeps its slot until its rollouts finish while TRL loads the next version).
"""

from __future__ import annotations

# TRL 1.16 AsyncGRPOConfig's default `max_staleness` (tests/serving/test_adapter_slots.py checks they agree).
DEFAULT_MAX_STALENESS = 4


def min_max_loras(max_staleness: int) -> int:
    """The fewest adapter slots TRL's AsyncGRPOTrainer accepts for `max_staleness` (`max_staleness + 2`)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness!r}")
    return max_staleness + 2


def max_loras_for(max_staleness: int) -> int:
    """The `--max-loras` replicas are started with for `max_staleness`: TRL's minimum plus the router's drain slot
    (`max_staleness + 3`)."""
    return min_max_loras(max_staleness) + 1
