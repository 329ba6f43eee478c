"""Result rows (one per measured point, the columns of docs/memory.md's *CSV columns*), the committed reference results,
and the tables drawn from them (savings vs a reference backend, max-batch ratios).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from grpo_lab.lab.outputs import committed_results
from grpo_lab.loss.backends import BASELINE_BACKEND, REFERENCE_BACKENDS

GiB = 1024**3

POINT_COLUMNS = ["figure", "model", "backend", "dtype", "mode", "generation", "batch_size", "prompt_len",
                 "completion_len", "lora_r", "fsdp", "world_size", "steps", "budget_gib", "status", "peak_gib",
                 "peak_generation_gib", "reserved_gib", "peak_raw_gib", "base_gib", "setup_gib", "step_time_s",
                 "wall_s", "memory_kind"]
ENV_COLUMNS = ["device", "gpu_name", "torch", "trl", "transformers", "peft", "accelerate", "liger_kernel", "date",
               "host"]
COLUMNS = POINT_COLUMNS + ENV_COLUMNS + ["message"]


def make_row(figure: str, spec, result: dict, env: dict) -> dict:
    kind = result.get("memory_kind", "")
    raw = result.get("peak_bytes")
    base = result.get("base_bytes") or 0
    ok = result["status"] == "ok"

    def gib(x):
        return None if x is None else x / GiB

    above = base if kind == "cpu_rss" else 0  # CPU: the peak RSS above the baseline; CUDA: allocated bytes
    gen = result.get("peak_generation_bytes")
    peak, gen = (raw - above, None if gen is None else gen - above) if ok else (None, None)
    row = {
        "figure": figure, "model": spec.model, "backend": spec.loss_backend, "dtype": spec.dtype, "mode": spec.mode,
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


def cli_error(message, status: int = 2) -> int:
    """A command line's one-line error on stderr; returns the exit status to end with (2: bad input)."""
    print(f"error: {message}", file=sys.stderr)
    return status


def rows_to_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=COLUMNS)


def write_csv(df: pd.DataFrame, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path


def load_reference(folder: str, name: str) -> pd.DataFrame | None:
    """The committed result `results/<folder>/<name>` (`lab.outputs.committed_results`), or None."""
    path = committed_results(folder) / name
    return pd.read_csv(path) if path.is_file() else None


def text_column(frame: pd.DataFrame, name: str) -> pd.Series:
    """`frame[name]` as strings, "" where empty: also for a CSV written before the column existed (e.g.
    `cuda_alloc_conf`, "" = the default allocator; `seeded_from`, "" = measured by the run itself)."""
    if name not in frame:
        return pd.Series("", index=frame.index, dtype=object)
    return frame[name].fillna("").astype(str)


def savings_table(df: pd.DataFrame, against: str = BASELINE_BACKEND) -> pd.DataFrame:
    """% peak saving of each backend vs `against`, per dtype and batch size (training-step points that ran)."""
    ok = df[(df["status"] == "ok")]
    piv = ok.pivot_table(index=["mode", "dtype", "batch_size"], columns="backend", values="peak_gib", aggfunc="max")
    if against not in piv.columns:  # also where nothing ran
        return pd.DataFrame()
    out = pd.DataFrame(index=piv.index)
    for b in piv.columns:
        if b != against:
            out[f"{b} vs {against} %"] = (1 - piv[b] / piv[against]) * 100
    return out.round(1)


def bound_kind(row) -> str:
    """'' for an exact max batch; 'capped' (a lower bound: "≥B") when the search hit its upper bound or was cut
    short before any OOM; 'incomplete' when it was cut short with the limit bracketed (max_batch fits, first_oom
    does not)."""
    if row.get("status") == "incomplete":
        return "incomplete" if pd.notna(row.get("first_oom")) else "capped"
    return "capped" if bool(row.get("capped", False)) else ""


def max_batch_label(row) -> str:
    """A search's max batch as shown: "≥1024" (a lower bound), "246–325" (cut short, bracketed) or "300"."""
    kind, v = bound_kind(row), int(row["max_batch"])
    return f"≥{v}" if kind == "capped" else f"{v}–{int(row['first_oom']) - 1}" if kind == "incomplete" else str(v)


def max_batch_ratio(num, den) -> str:
    """One search's max batch over another's ("1.52×"; "≥1.52×" from a lower bound), "" where the reference
    is missing, not positive or itself a lower bound (a lower bound over a lower bound says nothing)."""
    if num is None or den is None or bound_kind(den) or not den["max_batch"] > 0:
        return ""
    return f"{'≥' if bound_kind(num) else ''}{num['max_batch'] / den['max_batch']:.2f}×"


def ratio_table(df: pd.DataFrame) -> pd.DataFrame:
    """Max batch per model × backend with the ratios to naive and to trl, as display strings: "≥1024" where the
    search hit its cap, "246–325" where it was cut short with the limit bracketed (ratios then "≥"), and no ratio
    over a reference that is itself only a lower bound."""
    if df is None or df.empty:
        return pd.DataFrame()
    if "status" in df:
        df = df[df["status"].isin(["ok", "incomplete"])]
    models = list(dict.fromkeys(df["model"]))
    backends = list(dict.fromkeys(df["backend"]))
    cell = {(r["model"], r["backend"]): r for _, r in df.iterrows()}
    out = pd.DataFrame(index=pd.Index(models, name="model"))
    for b in backends:
        out[b] = [max_batch_label(cell[(m, b)]) if (m, b) in cell else "" for m in models]
    for ref in (r for r in REFERENCE_BACKENDS if r in backends):
        for b in (b for b in backends if b != ref):
            out[f"{b}/{ref}"] = [max_batch_ratio(cell.get((m, b)), cell.get((m, ref))) for m in models]
    return out
