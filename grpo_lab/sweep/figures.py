"""What a sweep shows of each run while it trains and after: its metrics rows (the loop's own
`loop_metrics.jsonl`), its curves side by side, its final reward, and its share of the pool (the router's per-run
figures, `GET /router/runs` with the admin key).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..async_loop.board import LOG_KEYS
from ..async_loop.recorder import METRICS_FILE, read_metrics

# a curve's name in a sweep -> its key in a metrics row (the board's names where it has them)
CURVES = {"reward": LOG_KEYS["reward"], "kl": "kl", "staleness": LOG_KEYS["staleness"],
          "rollout_wait_s": LOG_KEYS["rollout_wait_s"]}
FINAL_STEPS = 3  # a run's final reward is the mean of its last steps' (one step's 8-16 samples are noisy)
POOL_FIGURES = ("granted", "in_flight", "queued", "queue_wait_s", "weight_share")  # per run, from /router/runs


def step_rows(output_dir: str | os.PathLike) -> list[dict]:
    """The run's logged steps so far (its end-of-training summary row left out); [] before its first step."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [row for row in read_metrics(path) if "train_runtime" not in row and "step" in row]


def curve_points(rows: list[dict]) -> list[dict]:
    """Each step's curve values (`CURVES`), with its step: what a live plot of the run draws."""
    return [{"step": row["step"], **{name: row.get(key) for name, key in CURVES.items()}} for row in rows]


def mean_of_last(rows: list[dict], key: str, last: int = FINAL_STEPS) -> float:
    """The mean of `key` over the last `last` steps that logged it (NaN when none did)."""
    values = [row[key] for row in rows if isinstance(row.get(key), (int, float))][-last:]
    return sum(values) / len(values) if values else math.nan


def pool_shares(runs: list[dict]) -> dict[str, dict]:
    """Each run's figures from the pool's run list (`/router/runs`' `runs`), with `share`: its part of the
    completions the pool granted to the runs listed."""
    total = sum(r.get("granted", 0) for r in runs) or 0
    return {r["name"]: {**{key: r.get(key) for key in POOL_FIGURES},
                        "share": r.get("granted", 0) / total if total else math.nan} for r in runs}


def last_line(path: str | os.PathLike, tail_bytes: int = 8192) -> str:
    """The last non-empty line of a log file ('' when there is none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - tail_bytes, 0))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""
