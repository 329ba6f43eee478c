"""The loop's figures as files: a long-format CSV (run, step, metric, value + machine and versions) and the verdict.

`write_run(rows, folder, run=...)` writes `<folder>/<run>.csv` and `<run>_verdict.json`, so a notebook or a
benchmark commits the evidence a live board showed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from ..lab.records import run_record
from .board import board_values
from .doctor import DoctorConfig, diagnose, replica_notes, training_rows

KEEP = ("reward", "ratio", "loss", "kl", "entropy", "perf/step_s", "perf/fwd_bwd_s", "perf/rollout_wait_s",
        "perf/weight_sync_s", "perf/optimizer_s", "sample/rollout_queue_size", "sample/staleness_mean",
        "sample/staleness_max", "rollout/backpressure_s", "rollout/generated_tok_s", "rollout/inflight",
        "batch/samples_per_step", "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step",
        "perf/forwarded_tok_s_wall_clock", "perf/trained_tok_s_wall_clock", "sample/dropped_stale_total",
        "rollout/abandoned_groups_total", "completions/mean_length")


def run_frame(rows: list[dict], run: str, device: str = "auto", extra: dict | None = None) -> pd.DataFrame:
    """Long format: one (run, step, metric, value) per logged number, with machine and versions columns."""
    records, previous_router = [], None
    for row in training_rows(rows):
        values = {k: row[k] for k in KEEP if isinstance(row.get(k), (int, float))}
        derived = board_values(row, previous_router)
        values.update({k: derived[k] for k in ("completions_per_s", "affinity", "load_imbalance")
                       if derived.get(k) is not None})
        previous_router = row.get("router") or previous_router
        records += [{"run": run, "step": row["step"], "metric": k, "value": float(v)} for k, v in values.items()]
    frame = pd.DataFrame.from_records(records, columns=["run", "step", "metric", "value"])
    for key, value in {**run_record(device), **(extra or {})}.items():
        frame[key] = value
    return frame


def write_run(rows: list[dict], folder: str | os.PathLike, run: str, max_staleness: int,
              max_inflight_tasks: int | None = None, device: str = "auto", extra: dict | None = None,
              doctor: DoctorConfig | None = None) -> Path:
    """Write `<folder>/<run>.csv` and `<folder>/<run>_verdict.json`; returns the CSV path.

    `doctor`: the diagnosis' thresholds; `DoctorConfig.for_replicas("cpu")` for a loop on CPU replicas."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run}.csv"
    run_frame(rows, run, device, extra).to_csv(path, index=False)
    verdict = diagnose(rows, max_staleness, max_inflight_tasks, doctor)
    (folder / f"{run}_verdict.json").write_text(json.dumps({
        "run": run, "bound": verdict.bound, "headline": verdict.headline, "knobs": verdict.knobs,
        "evidence": verdict.evidence, "notes": verdict.notes + replica_notes(rows)}, indent=1))
    return path
