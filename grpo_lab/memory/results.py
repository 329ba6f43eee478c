"""Result rows, the machine/version stamp every CSV carries, and the committed reference results.

One CSV row per measured point (tidy/long format): the point's coordinates, its outcome (`status` ok | oom), the peak
memory in GiB, and the machine and library versions. `peak_gib` is the allocator peak on CUDA
(`torch.cuda.max_memory_allocated`) and, on CPU, the probe process's peak RSS above its baseline after imports.
"""

from __future__ import annotations

import datetime as _dt
import functools
import platform
from importlib import metadata, resources
from pathlib import Path

import pandas as pd

GiB = 1024**3

POINT_COLUMNS = ["figure", "model", "backend", "dtype", "mode", "generation", "batch_size", "prompt_len",
                 "completion_len", "lora_r", "fsdp", "world_size", "steps", "budget_gib", "status", "peak_gib",
                 "peak_generation_gib", "reserved_gib", "peak_raw_gib", "base_gib", "setup_gib", "step_time_s",
                 "wall_s", "memory_kind"]
ENV_COLUMNS = ["device", "gpu_name", "torch", "trl", "transformers", "peft", "accelerate", "liger_kernel", "date",
               "host"]
COLUMNS = POINT_COLUMNS + ENV_COLUMNS + ["message"]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=None)
def environment(device: str = "auto") -> dict:
    """Machine + versions. The parent never initialises CUDA for this: the GPU name comes from NVML/nvidia-smi."""
    import torch

    gpu = ""
    if device in ("auto", "cuda"):
        gpu = _gpu_name()
    return {
        "device": "cuda" if gpu else "cpu",
        "gpu_name": gpu or f"CPU ({platform.processor() or platform.machine()}, {_cpu_count()} cores)",
        "torch": torch.__version__,
        "trl": _version("trl"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "accelerate": _version("accelerate"),
        "liger_kernel": _version("liger-kernel") or _version("liger_kernel"),
        "date": _dt.date.today().isoformat(),
        "host": platform.node(),
    }


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _gpu_name() -> str:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20).stdout.strip().splitlines()
            if out:
                return out[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_device_name(0)
    return ""


def make_row(figure: str, spec, result: dict, env: dict) -> dict:
    kind = result.get("memory_kind", "")
    raw = result.get("peak_bytes")
    base = result.get("base_bytes") or 0
    ok = result["status"] == "ok"

    def gib(x):
        return None if x is None else x / GiB

    if ok and kind == "cpu_rss":
        peak = raw - base
        gen = None if result.get("peak_generation_bytes") is None else result["peak_generation_bytes"] - base
    else:
        peak, gen = (raw, result.get("peak_generation_bytes")) if ok else (None, None)
    row = {
        "figure": figure, "model": spec.model, "backend": spec.backend, "dtype": spec.dtype, "mode": spec.mode,
        "generation": spec.generation if spec.mode == "step" else "none", "batch_size": spec.batch_size,
        "prompt_len": spec.prompt_len if spec.mode == "step" else 0, "completion_len": spec.completion_len,
        "lora_r": spec.lora_r, "fsdp": spec.fsdp, "world_size": spec.world_size, "steps": spec.steps,
        "budget_gib": gib(spec.budget_bytes), "status": result["status"], "peak_gib": gib(peak),
        "peak_generation_gib": gib(gen), "reserved_gib": gib(result.get("reserved_bytes")) if ok else None,
        "peak_raw_gib": gib(raw) if ok else None, "base_gib": gib(base) if ok else None,
        "setup_gib": gib(result.get("setup_bytes")) if ok else None,  # model + optimizer before the step
        "step_time_s": result.get("step_time_s") if ok else None, "wall_s": result.get("wall_s"),
        "memory_kind": kind or ("cuda_allocated" if env.get("device") == "cuda" else "cpu_rss"),
        "message": (result.get("message") or "")[:300].replace("\n", " "),
    }
    row.update({k: env.get(k, "") for k in ENV_COLUMNS})
    if result.get("device_name"):  # the probe's own view wins (the parent never initialises CUDA)
        row["device"], row["gpu_name"] = "cuda", result["device_name"]
    return row


def target_csv(out: str | Path, name: str, keep: bool, overwrite: bool) -> Path:
    """`out/name.csv`, the CSV a command line will write; a `ValueError` when that would be a mistake: `out` is a
    file, or the CSV exists and the run would replace it unasked (the committed H200 results sit at the CLIs'
    default paths)."""
    csv = Path(out) / f"{name}.csv"
    if csv.parent.exists() and not csv.parent.is_dir():
        raise ValueError(f"--out {csv.parent} is a file, not a folder")
    if csv.exists() and not (keep or overwrite):
        raise ValueError(f"{csv} exists; pass --overwrite to replace it, --resume (or --append) to add to it, or "
                         "another --out")
    return csv


def rows_to_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=COLUMNS)


def write_csv(rows_or_df, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df = rows_or_df if isinstance(rows_or_df, pd.DataFrame) else rows_to_frame(rows_or_df)
    df.to_csv(path, index=False)
    return path


def reference_csv(folder: str, name: str) -> Path | None:
    """A committed result shipped as `grpo_lab.reference_results/<folder>/<name>` (the repo's `results/`)."""
    try:
        p = resources.files("grpo_lab.reference_results").joinpath(folder, name)
        if p.is_file():
            return Path(str(p))
    except (ModuleNotFoundError, FileNotFoundError):
        pass
    local = Path(__file__).resolve().parents[2] / "results" / folder / name
    return local if local.is_file() else None


def text_column(frame: pd.DataFrame, name: str) -> pd.Series:
    """`frame[name]` as strings, "" where empty: also for a CSV written before the column existed (e.g.
    `cuda_alloc_conf`, "" = the default allocator; `seeded_from`, "" = measured by the run itself)."""
    if name not in frame:
        return pd.Series("", index=frame.index, dtype=object)
    return frame[name].fillna("").astype(str)


def load_reference(folder: str, name: str) -> pd.DataFrame | None:
    p = reference_csv(folder, name)
    return None if p is None else pd.read_csv(p)


def savings_table(df: pd.DataFrame, against: str = "naive") -> pd.DataFrame:
    """% peak saving of each backend vs `against`, per dtype and batch size (training-step points that ran)."""
    ok = df[(df["status"] == "ok")]
    if ok.empty:
        return pd.DataFrame()
    piv = ok.pivot_table(index=["mode", "dtype", "batch_size"], columns="backend", values="peak_gib", aggfunc="max")
    if against not in piv.columns:
        return pd.DataFrame()
    out = pd.DataFrame(index=piv.index)
    for b in piv.columns:
        if b != against:
            out[f"{b} vs {against} %"] = (1 - piv[b] / piv[against]) * 100
    return out.round(1)
