"""Every logged step of the async loop as one JSON line, with the router's view beside the trainer's.

The trainer's logs say which side waited (step time, forward/backward, rollout wait, queue size, backpressure,
staleness, ratio); the router's `/router/state` says where rollouts went (per-replica load and routing decisions).
Both land in `<output_dir>/loop_metrics.jsonl`, which the bottleneck board, the doctor and the tests read.
"""

from __future__ import annotations

import json
import os
import time

from transformers import TrainerCallback

from .pool import run_get

METRICS_FILE = "loop_metrics.jsonl"


def router_snapshot(url: str | None, timeout: float = 2.0) -> dict | None:
    """The router's routing counts and per-replica load, or None when there is no grpo_lab router at `url`. On a
    shared pool the run's token makes it the run's own figures (its routing, its completions per replica)."""
    body = run_get(url, "/router/state", timeout) if url else None
    if body is None:
        return None
    return {"routing": body.get("routing", {}),
            "in_flight": {r["url"]: r.get("in_flight", 0) for r in body.get("replicas", [])},
            "replica_states": {r["url"]: r.get("state") for r in body.get("replicas", [])}}


def router_figures(snapshot: dict | None, before: dict | None) -> dict:
    """What `snapshot` says since the snapshot `before`: the routing decisions (`<decision>_total`), the share that
    found their prefix cached (`affinity_share`, when there were decisions), the requests in flight at the replicas
    (`in_flight`) and their max/mean (`load_imbalance`, when any are in flight)."""
    if not snapshot:
        return {}
    routing, past = snapshot.get("routing") or {}, (before or {}).get("routing") or {}
    delta = {k: v - past.get(k, 0) for k, v in routing.items()}
    figures = {f"{k}_total": float(v) for k, v in delta.items()}
    if sum(delta.values()) > 0:
        figures["affinity_share"] = delta.get("affinity", 0) / sum(delta.values())
    loads = list((snapshot.get("in_flight") or {}).values())
    if loads:
        figures["in_flight"] = float(sum(loads))
        if sum(loads) > 0:
            figures["load_imbalance"] = max(loads) / (sum(loads) / len(loads))
    return figures


class LoopRecorder(TrainerCallback):
    """Appends `{"step", "time", **logs, "router": {...}}` to `<output_dir>/loop_metrics.jsonl` at every log."""

    def __init__(self, router_url: str | None = None):
        self.router_url = router_url
        self.extras: list = []  # callables returning more of the row (the autotune decisions of the step)
        self.rows: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step, "time": time.time(), **logs}
        snapshot = router_snapshot(self.router_url)
        if snapshot is not None:
            row["router"] = snapshot
        for extra in self.extras:
            row.update(extra())
        self.rows.append(row)
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, METRICS_FILE), "a") as f:
            f.write(json.dumps(row, default=float) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a `loop_metrics.jsonl` (a truncated last line, from a killed run, is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows
