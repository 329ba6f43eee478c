"""Peak-memory meters with a resettable peak, one per device kind.

CUDA: the caching allocator's peak statistics. CPU: the peak resident set (Linux `VmHWM`, reset through
`/proc/self/clear_refs`), else `ru_maxrss`, which cannot be reset (every phase then reports the process-wide peak).
"""

from __future__ import annotations

import resource
import sys

import torch

from grpo_lab.lab import environment

GiB = 1024**3


def _read_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None


class CpuRssMeter:
    kind = "cpu_rss"

    def __init__(self):
        self.resettable = self._try_reset()

    @staticmethod
    def _try_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _read_status_kib("VmHWM") is not None
        except OSError:
            return False

    def current(self) -> int:
        kib = _read_status_kib("VmRSS")
        if kib is None:
            import psutil

            return psutil.Process().memory_info().rss
        return kib * 1024

    def reset_peak(self) -> None:
        if self.resettable:
            self._try_reset()

    def peak(self) -> dict[str, int]:
        kib = _read_status_kib("VmHWM") if self.resettable else None
        if kib is None:
            ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            kib = ru // 1024 if sys.platform == "darwin" else ru
        return {"peak": kib * 1024}

    def sync(self) -> None:
        pass


class CudaMeter:
    kind = "cuda_allocated"

    def __init__(self, device: torch.device):
        self.device = device

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> dict[str, int]:
        torch.cuda.synchronize(self.device)
        return {"peak": torch.cuda.max_memory_allocated(self.device),
                "reserved": torch.cuda.max_memory_reserved(self.device)}

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


class BudgetExceeded(MemoryError):
    """A CPU probe whose measured peak went over the memory budget: recorded as out-of-memory."""


def check_budget(meter, used: int, budget: int | None) -> None:
    """CPU: a peak RSS `used` above the baseline over `budget` is out of memory (CUDA: the allocator's cap)."""
    if budget is not None and meter.kind == "cpu_rss" and used > budget:
        raise BudgetExceeded(f"peak RSS above baseline {used / GiB:.3f} GiB over the budget {budget / GiB:.3f} GiB")


def is_oom_error(exc: BaseException) -> bool:
    """Out-of-memory from any layer: torch's CUDA OOM, a host `MemoryError`, allocator messages, a budget overrun."""
    if isinstance(exc, MemoryError | torch.cuda.OutOfMemoryError):  # BudgetExceeded is a MemoryError
        return True
    text = str(exc).lower()
    return any(s in text for s in ("out of memory", "cuda_error_out_of_memory", "can't allocate memory",
                                   "cannot allocate memory", "defaultcpuallocator: not enough memory"))


def device_info(device: torch.device) -> dict:
    """What the probe itself sees of its accelerator: name and total memory (nothing on CPU)."""
    if device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    return {"device_name": props.name, "device_total_bytes": props.total_memory}


def prepare_probe_device(spec_device: str, budget_bytes: int | None):
    """The probe's device (`auto`: CUDA if there is one) and meter; on CUDA the allocator is capped at
    `budget_bytes`, so an over-budget point fails as a real out-of-memory rather than by a check after the fact."""
    if spec_device == "cpu" or (spec_device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu"), CpuRssMeter()
    device = torch.device("cuda", environment.local_rank())
    torch.cuda.set_device(device)
    if budget_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    return device, CudaMeter(device)
