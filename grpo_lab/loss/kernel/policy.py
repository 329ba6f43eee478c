"""The memory policy of a trainable head, and the counts of the paths the kernel took.

A trainable head has two ways to its gradient (docs/kernel.md): the memory-flat recompute path (four GEMMs over
N·V·H) and the materialised one (three GEMMs; its forward keeps the [N, V] probabilities in the compute dtype until
the head's backward is done). On the H200 the materialised path is 11-26 % faster from 8192 rows in bf16 and 12-20 %
in fp32 (a 16-bit head under 2^22 rows × hidden is host-bound and stays flat: `materialize_flat_below`), but its
buffer grows with N. So the
kernel keeps it when it fits in a budget of the device memory free at that moment:
`materialize_fraction` (default one half) of what the allocator could hand out now, and always 2 GiB to spare. Half,
so that what the step allocates while the buffer lives — the loss, the head's backward (dX in fp32, dW) — has the
other half: a step that fits with the flat path also fits with the buffer, and a batch at the memory limit finds too
little free and stays flat. `materialize_fraction = 0` (`GRPO_LAB_MATERIALIZE_FRACTION=0`) is always flat; an explicit
allowance in GiB (`materialize_gib`, `GRPO_LAB_MATERIALIZE_GIB`, the older opt-in) replaces the fraction.

Which path each call took is counted (`path_counts()`), so a user or the benchmark can see whether the buffer was
kept. No Triton (nor, until the free memory is read, torch) import here: `grpo_lab.loss.kernel` re-exports the counts
and stays light to import; the decision and the counts are plain Python, tested on CPUs.
"""

from __future__ import annotations

import dataclasses
import threading

SPARE_BYTES = 2 * 2**30  # never leave less than this free, whatever the budget


def materialize_decision(need_bytes: int, free_bytes: int, fraction: float, allowance_bytes: float | None = None,
                         spare_bytes: int = SPARE_BYTES) -> bool:
    """Whether a trainable head keeps its [N, V] probabilities (`need_bytes`) given `free_bytes` free now.

    With `allowance_bytes` (the user's explicit `materialize_gib`) the buffer must be at most that; otherwise at most
    `fraction` of the free memory (0: never). Either way `spare_bytes` must stay free beside it. A pure function of
    its arguments, so the policy is tested without a GPU."""
    if need_bytes <= 0 or need_bytes + spare_bytes > free_bytes:
        return False
    if allowance_bytes is not None:
        return need_bytes <= allowance_bytes
    return need_bytes <= fraction * free_bytes


def free_device_bytes(device) -> int:
    """Bytes the caching allocator could hand out now: the driver's free memory (`torch.cuda.mem_get_info`) plus what
    the allocator holds reserved but unallocated (after a training step that is most of the free memory; the
    allocator returns its cached blocks to the driver and retries before it reports an out-of-memory error)."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0))


@dataclasses.dataclass
class PathCounts:
    """Calls of the kernel per path since the last `reset_path_counts()`.

    Args:
        stats (`int`): no gradient needed (old / reference log-probs): statistics only.
        frozen (`int`): the frozen head's two-GEMM path.
        recompute (`int`): the recomputing backward: a trainable head kept flat, a small frozen head, fp16.
        materialized (`int`): a trainable head that kept its [N, V] probabilities (the memory policy said yes).
        flat_for_memory (`int`): of the `recompute` calls, trainable heads the policy kept flat because the buffer
            did not fit its budget (with the policy on: `materialize_fraction` > 0 or an allowance > 0).
    """

    stats: int = 0
    frozen: int = 0
    recompute: int = 0
    materialized: int = 0
    flat_for_memory: int = 0


_COUNTS = PathCounts()
_LOCK = threading.Lock()


def record_path(path: str, flat_for_memory: bool = False) -> None:
    """Count one call of the kernel on `path` (`stats`, `frozen`, `recompute` or `materialized`)."""
    with _LOCK:
        setattr(_COUNTS, path, getattr(_COUNTS, path) + 1)
        _COUNTS.flat_for_memory += int(flat_for_memory)


def path_counts() -> PathCounts:
    """A copy of the counts: which path the kernel took how often since the last reset."""
    with _LOCK:
        return dataclasses.replace(_COUNTS)


def reset_path_counts() -> None:
    with _LOCK:
        for f in dataclasses.fields(PathCounts):
            setattr(_COUNTS, f.name, 0)
