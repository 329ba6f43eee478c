"""The memory policy of a trainable head, and the counts of the paths the kernel took.

A trainable head either recomputes its logits in the backward (memory-flat, four GEMMs) or keeps its [N, V]
probabilities from the forward (three GEMMs, faster from a few thousand rows, but a buffer that grows with N). The
head runs at the top of a training step's activation peak, so the memory free at that moment says little about what
the buffer costs the step: by default it is kept only where it fits *under the peak the run has already reached*
(the allocator's high-water mark, e.g. the optimizer step or an earlier step's backward), so keeping it never raises
the run's peak, and also within `materialize_fraction` of the free memory with 2 GiB to spare
(`tuning.KernelTuning`, docs/kernel.md). Which path each call took is counted (`path_counts()`). Plain Python (no
Triton; torch only to read the allocator's counters), tested on CPUs.
"""

from __future__ import annotations

import dataclasses
import threading

SPARE_BYTES = 2 * 2**30  # never leave less than this free, whatever the budget


def materialize_decision(need_bytes: int, free_bytes: int, fraction: float, allowance_bytes: float | None = None,
                         spare_bytes: int = SPARE_BYTES, room_below_peak: int | None = None,
                         backward_bytes: int = 0) -> bool:
    """Whether a trainable head keeps its [N, V] probabilities (`need_bytes`) given `free_bytes` free now.

    At most `allowance_bytes` (an explicit `materialize_gib`: the user spends that memory knowingly), else
    `fraction` of the free memory (0: never) and, when `room_below_peak` is given (the bytes between what is
    allocated now and the run's high-water mark), only if the buffer and what the head's backward allocates beside
    it (`backward_bytes`: dX in fp32, X scaled per row, dW) fit in that room, so the step's peak cannot rise.
    `spare_bytes` stay free either way. Pure, so the policy is tested without a GPU."""
    if need_bytes <= 0 or need_bytes + spare_bytes > free_bytes:
        return False
    if allowance_bytes is not None:
        return need_bytes <= allowance_bytes
    if room_below_peak is not None and need_bytes + backward_bytes > room_below_peak:
        return False
    return need_bytes <= fraction * free_bytes


def free_device_bytes(device) -> int:
    """Bytes the caching allocator could hand out now: the driver's free memory plus what it holds reserved but
    unallocated (after a training step, most of it; the allocator frees its cache and retries before an OOM)."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0))


def room_below_peak(device) -> int:
    """Bytes the head may hold without raising the run's peak: the allocator's high-water mark since its last reset
    (`torch.cuda.max_memory_allocated`: an earlier step's backward or optimizer step) minus what is allocated now.
    Right after a reset (a memory probe's) it is about 0, so the policy errs toward the flat path."""
    import torch

    return int(torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device))


@dataclasses.dataclass
class PathCounts:
    """Calls of the kernel per path since the last `reset_path_counts()`.

    Args:
        stats (`int`): no gradient needed (old / reference log-probs): statistics only.
        frozen (`int`): the frozen head's two-GEMM path.
        recompute (`int`): the recomputing backward: a trainable head kept flat, a small frozen head, fp16.
        materialized (`int`): a trainable head that kept its [N, V] probabilities (the memory policy said yes).
        flat_for_memory (`int`): of the `recompute` calls, trainable heads the (enabled) policy kept flat for memory
            (the buffer would have raised the run's peak, or did not fit the free memory).
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
