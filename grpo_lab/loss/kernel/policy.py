"""The memory policy of a trainable head, and the counts of the paths the kernel took.

A trainable head either recomputes its logits in the backward (memory-flat, four GEMMs) or keeps its [N, V]
probabilities from the forward (three GEMMs, faster from a few thousand rows, but a buffer that grows with N). It
keeps them when they fit `materialize_fraction` of the memory free at that moment with 2 GiB to spare, so a batch at
the memory limit stays flat (`tuning.KernelTuning`, docs/kernel.md). Which path each call took is counted
(`path_counts()`). Plain Python (no Triton; torch only to read the free memory), tested on CPUs.
"""

from __future__ import annotations

import dataclasses
import threading

SPARE_BYTES = 2 * 2**30  # never leave less than this free, whatever the budget


def materialize_decision(need_bytes: int, free_bytes: int, fraction: float, allowance_bytes: float | None = None,
                         spare_bytes: int = SPARE_BYTES) -> bool:
    """Whether a trainable head keeps its [N, V] probabilities (`need_bytes`) given `free_bytes` free now.

    At most `allowance_bytes` (an explicit `materialize_gib`), else `fraction` of the free memory (0: never), with
    `spare_bytes` free beside it either way. Pure, so the policy is tested without a GPU."""
    if need_bytes <= 0 or need_bytes + spare_bytes > free_bytes:
        return False
    if allowance_bytes is not None:
        return need_bytes <= allowance_bytes
    return need_bytes <= fraction * free_bytes


def free_device_bytes(device) -> int:
    """Bytes the caching allocator could hand out now: the driver's free memory plus what it holds reserved but
    unallocated (after a training step, most of it; the allocator frees its cache and retries before an OOM)."""
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
        flat_for_memory (`int`): of the `recompute` calls, trainable heads the (enabled) policy kept flat for memory.
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
