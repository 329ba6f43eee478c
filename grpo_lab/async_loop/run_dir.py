"""An output directory holds one run: its checkpoints, its metrics log, its record of settings, nothing else's.

A second run into the same folder would silently mix two runs (a later `--resume` picking the old run's checkpoint,
one metrics log with steps 1..20, 20, 1, 2), so a command refuses a folder that holds a run unless it resumes it or
is told to start over (`--overwrite`). After a resume the metrics log keeps only the steps up to the checkpoint.
`run.json` records the settings the run started with, so `grpo-lab doctor` judges a run by its own settings. The run's
log also travels inside each checkpoint (`RUN_LOG_DIR`), so a resume on another machine brings the history back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..lab.files import write_atomically
from .checkpoints import is_checkpoint_name
from .checks import check_writable_folder
from .recorder import METRICS_FILE, read_metrics

RUN_RECORD = "run.json"
# What a run of the async loop writes into its output directory (and `--overwrite` may therefore remove).
REPLICA_LOGS = "logs"  # the replicas' output (Ray replicas' copied back from their nodes), the router's log
RUN_ENTRIES = (RUN_RECORD, METRICS_FILE, REPLICA_LOGS, ".vllm_lora", "runs")
RUN_LOG_DIR = "grpo_lab_run"  # inside a checkpoint: the run's log as of that step (RUN_LOG_FILES)
RUN_LOG_FILES = (METRICS_FILE, RUN_RECORD)


class RunDirError(ValueError):
    """The output directory cannot be used as asked; the message names the flag and what to do."""


def holds_a_run(folder: Path) -> bool:
    return folder.is_dir() and any(entry.name in RUN_ENTRIES or is_checkpoint_name(entry.name)
                                   for entry in folder.iterdir())


def check_output_dir(output_dir: str | os.PathLike, resume: bool, overwrite: bool) -> None:
    """Refuse what would mix runs or fail later (UsageError for a folder that cannot be written); touch nothing."""
    folder = Path(output_dir)
    check_writable_folder("--output-dir", str(folder))
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: resume the run, or start it over")
    if resume or not folder.is_dir() or not any(folder.iterdir()):
        return
    if not overwrite:
        raise RunDirError(f"--output-dir: {folder} already holds files; pass --resume to continue its run, "
                          f"--overwrite to delete that run and start over, or choose another folder")
    if not holds_a_run(folder):
        raise RunDirError(f"--overwrite: {folder} holds files that are not an async-loop run; it is left alone "
                          f"(choose an empty or new folder)")


def clear_previous_run(output_dir: str | os.PathLike) -> list[str]:
    """Delete what a previous run wrote into `output_dir` (`--overwrite`); returns the names removed."""
    folder = Path(output_dir)
    removed = []
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        if entry.name in RUN_ENTRIES or is_checkpoint_name(entry.name):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry.name)
    return removed


def truncate_metrics(output_dir: str | os.PathLike, last_step: int) -> int:
    """Keep the metrics log's rows up to `last_step` (the checkpoint a resume starts from); returns how many rows
    were dropped. Rows after the checkpoint belong to steps the resumed run trains again, and an end-of-training
    summary row (`train_runtime`) belongs to a process that ended: the resumed one writes its own."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by the kill
            dropped += 1
            continue
        step = row.get("step")
        if (isinstance(step, int) and step > last_step) or "train_runtime" in row:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_atomically(path, "".join(f"{line}\n" for line in kept))
    return dropped


def write_run_record(output_dir: str | os.PathLike, settings: dict) -> Path:
    """Merge `settings` into `<output_dir>/run.json` (a resume adds to the first run's record)."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RUN_RECORD
    record = read_run_record(folder) or {}
    record.update(settings)
    write_atomically(path, json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
    return path


def read_run_record(run: str | os.PathLike) -> dict | None:
    """The settings a run recorded (`run` is its folder or any file in it); None when it has no record."""
    folder = Path(run)
    if folder.is_file() or (not folder.is_dir() and folder.suffix):
        folder = folder.parent
    path = folder / RUN_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def last_logged_step(path: str | os.PathLike) -> int:
    """The highest step of a metrics log (-1: none, or no file)."""
    try:
        rows = read_metrics(path)
    except OSError:
        return -1
    return max((row["step"] for row in rows if isinstance(row, dict) and isinstance(row.get("step"), int)),
               default=-1)


def snapshot_run_log(output_dir: str | os.PathLike, checkpoint: str | os.PathLike, step: int) -> list[str]:
    """Copy the run's log (`RUN_LOG_FILES` of `output_dir`) into `<checkpoint>/RUN_LOG_DIR`, the metrics cut to
    `step`; returns the names copied. Called when a checkpoint is published, so the store holds the history too."""
    dest = Path(checkpoint) / RUN_LOG_DIR
    copied = []
    for name in RUN_LOG_FILES:
        source = Path(output_dir) / name
        if source.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest / name)
            copied.append(name)
    truncate_metrics(dest, step)
    return copied


def restore_run_log(checkpoint: str | os.PathLike, output_dir: str | os.PathLike) -> list[str]:
    """Bring a checkpoint's copy of the run's log back into `output_dir` where it knows more: the metrics log when
    `output_dir` has none or one that stops before the checkpoint's (a fresh machine), `run.json` when there is none.
    Returns the names restored (the resume then cuts the metrics to the checkpoint's step as always)."""
    source, folder = Path(checkpoint) / RUN_LOG_DIR, Path(output_dir)
    restored = []
    metrics = source / METRICS_FILE
    if metrics.is_file() and last_logged_step(metrics) > last_logged_step(folder / METRICS_FILE):
        write_atomically(folder / METRICS_FILE, metrics.read_text())
        restored.append(METRICS_FILE)
    if (source / RUN_RECORD).is_file() and read_run_record(folder) is None:
        write_atomically(folder / RUN_RECORD, (source / RUN_RECORD).read_text())
        restored.append(RUN_RECORD)
    return restored
