"""The run in the user's own tracker, and back: trackio, TensorBoard and Weights & Biases through transformers.

Logging goes through the trainer's `report_to`: TRL already logs the loop's timings, autotune adds `autotune/*`, and
`RouterFigures` adds the router's routing and cache figures (`router/*`) per step. `read_run(path)` reads a run back
as `loop_metrics.jsonl`-style rows (TRL's names, without the integrations' `train/` prefix) for the doctor, from the
loop's own metrics log, a trackio directory (its local SQLite store) or a TensorBoard log directory.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from transformers import TrainerCallback

from .recorder import METRICS_FILE, read_metrics, router_figures, router_snapshot

UNTRACKED = "train/"  # the prefix transformers' integrations give the trainer's names
SUMMARY = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


class RouterFigures(TrainerCallback):
    """Adds the router's `router/*` figures to every log (put it first among the callbacks, so that the trackers'
    callbacks see them)."""

    def __init__(self, router_url: str | None):
        self.router_url = router_url
        self._before: dict | None = None  # the last snapshot

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        logs.update(self.figures(router_snapshot(self.router_url)))

    def figures(self, snapshot: dict | None) -> dict:
        values = {f"router/{k}": v for k, v in router_figures(snapshot, self._before).items()}
        self._before = snapshot or self._before
        return values


# -- reading a run back -------------------------------------------------------------------------------------------
def _trackio_db(path: Path, project: str | None) -> Path | None:
    if path.is_file() and path.suffix == ".db":
        return path
    dbs = sorted(path.glob("*.db"))  # none under a file or a missing folder
    if project is not None:
        dbs = [d for d in dbs if d.stem == project]
    return dbs[0] if len(dbs) == 1 else None


def read_trackio(db: Path, run: str | None = None) -> tuple[list[dict], str]:
    """Rows of one run in a trackio project's SQLite file (the newest run unless `run` names one)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        names = [r[0] for r in conn.execute("SELECT run_name FROM metrics GROUP BY run_name ORDER BY MAX(id)")]
        if not names:
            raise ValueError(f"{db} holds no logged run")
        if run is None:
            run = names[-1]
        elif run not in names:
            raise ValueError(f"{db} has no run {run!r} (runs: {', '.join(names)})")
        found = conn.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY id", (run,)).fetchall()
    rows = []
    for step, blob in found:
        metrics = json.loads(blob)
        row = {k.removeprefix(UNTRACKED): v for k, v in metrics.items() if isinstance(v, (int, float))}
        row["step"] = int(row.pop("global_step", step))
        rows.append(row)
    return rows, f"trackio project {db.stem}, run {run}"


def _event_files(path: Path) -> list[Path]:
    if path.is_file() and "tfevents" in path.name:
        return [path]
    return sorted(path.rglob("events.out.tfevents.*"))  # none under a file or a missing folder


def read_tensorboard(files: list[Path]) -> tuple[list[dict], str]:
    """Rows from TensorBoard event files (the scalars, one row per step; the newest run's folder when there are
    several)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = max({f.parent for f in files}, key=lambda d: max(f.stat().st_mtime for f in d.glob("*tfevents*")))
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    by_step: dict[int, dict] = {}
    for tag in accumulator.Tags().get("scalars", []):
        if tag.removeprefix(UNTRACKED) in SUMMARY:  # the end-of-training summary shares the last step's number
            continue
        for event in accumulator.Scalars(tag):
            by_step.setdefault(int(event.step), {})[tag.removeprefix(UNTRACKED)] = float(event.value)
    rows = [{"step": step, **values} for step, values in sorted(by_step.items())]
    return rows, f"TensorBoard run {folder}"


def read_run(path: str | os.PathLike, project: str | None = None, run: str | None = None) -> tuple[list[dict], str]:
    """A run's logged rows and where they came from: `loop_metrics.jsonl` (or a folder holding it), a trackio
    directory or `.db` file, or a TensorBoard log directory. Raises FileNotFoundError when `path` is none of them."""
    path = Path(path)
    metrics = path / METRICS_FILE if path.is_dir() else path
    if metrics.is_file() and metrics.suffix == ".jsonl":
        return read_metrics(metrics), f"metrics log {metrics}"
    db = _trackio_db(path, project)
    if db is not None:
        return read_trackio(db, run)
    files = _event_files(path)
    if files:
        return read_tensorboard(files)
    if len(list(path.glob("*.db"))) > 1 and project is None:
        raise FileNotFoundError(f"{path} holds several trackio projects: name one with --project")
    raise FileNotFoundError(f"{path} is not a run: no {METRICS_FILE}, trackio .db or TensorBoard event file")
