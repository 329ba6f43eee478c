"""What a results file records about the run behind it: machine, accelerator, package versions, date.

Every CSV under `results/` carries these columns, so a figure can always be traced to the machine and the versions
that made it; `run_record` builds them for every writer.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import platform
import shutil
import subprocess
from importlib import metadata

# The distributions whose versions a result depends on; a missing one is recorded as "".
PACKAGES = ("torch", "triton", "trl", "transformers", "peft", "accelerate", "liger-kernel", "vllm")


def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi, so recording never initialises CUDA in the calling process; torch's
    name only when CUDA is already initialised here. "" without a GPU."""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20).stdout.strip().splitlines()
            if out:
                return out[0].strip()
    import torch  # a dependency of grpo-lab, imported here only when a record is made

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() and torch.cuda.is_initialized() else ""


@functools.lru_cache(maxsize=None)
def _machine(device: str) -> dict:
    gpu = gpu_name() if device in ("auto", "cuda") or device.startswith("cuda:") else ""
    cores = usable_cores()
    return {
        "device": "cuda" if gpu else "cpu",
        "gpu_name": gpu or f"CPU ({platform.processor() or platform.machine()}, {cores} cores)",
        "host": platform.node(),
        "machine": f"{platform.node()} ({cores} cores)",
        "cpu": cpu_model(),
        "python": platform.python_version(),
        **{dist.replace("-", "_"): package_version(dist) for dist in PACKAGES},
    }


def run_record(device: str = "auto") -> dict:
    """Machine, versions, torch's thread count, the load on the machine and the UTC date, as flat string-ish
    columns. `device`: "auto" or "cuda" looks for a GPU, "cpu" records the CPU only."""
    import torch

    record = dict(_machine(device))
    record["torch_threads"] = torch.get_num_threads()  # CPU figures depend on it (summation order, speed)
    record["load_avg_1m"] = f"{os.getloadavg()[0]:.2f}"  # other work on the machine skews timings
    record["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return record
