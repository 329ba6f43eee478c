"""The bottleneck doctor: which side of the async loop waits, and the one knob to turn next.

The author of the Hugging Face blog post on async GRPO with LoRA made training 3.9x faster over five runs by reading
which side of the loop waited and turning one knob per run. `diagnose(rows)` reads the last `window` logged steps
(TRL's metric names) and returns a `Verdict`: rollout-, train- or staleness-bound, or balanced, with the knobs in the
order to try (the table in docs/async_loop.md, "Which side waits"). Replicas that serve one request at a time
(`DoctorConfig.replicas_batch=False`) are never told "more in flight", only "more replicas".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from ..lab.settings import Range, setting
from ..lab.settings_parser import ConfigParser
from ..serving.adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for
from .loop_settings import REPLICA_KINDS, like
from .recorder import router_figures
from .run_dir import REPLICA_LOGS, RUN_RECORD, read_run_record


@dataclass
class DoctorConfig:
    """Thresholds of the diagnosis, as shares of the mean step time (`*_wait_frac`, `sync_frac`), of the samples
    produced (`stale_frac`), of `max_staleness` (`staleness_frac`, a note only) or of `max_inflight_tasks`
    (`inflight_saturated`: every slot busy); `queue_steps` of samples queued means the trainer is behind.
    `replicas_batch`: a replica serves many requests at once (vLLM) or one at a time (the CPU replica)."""

    window: int = 10
    rollout_wait_frac: float = 0.25
    train_wait_frac: float = 0.05
    queue_steps: float = 0.5
    stale_frac: float = 0.05
    staleness_frac: float = 0.75
    inflight_saturated: float = 0.9
    sync_frac: float = 0.3
    replicas_batch: bool = True

    @classmethod
    def for_replicas(cls, replica_kind: str, **overrides) -> "DoctorConfig":
        """Thresholds for a loop on `replica_kind` replicas ("cpu": one request at a time; "vllm": batching)."""
        return cls(replicas_batch=replica_kind != "cpu", **overrides)


@dataclass
class Verdict:
    """What bounds the loop, why (the numbers read), and what to turn."""

    bound: str  # "rollout" | "train" | "staleness" | "balanced" | "unknown"
    knobs: list[str]
    evidence: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def headline(self) -> str:
        if self.bound == "unknown":
            return "not enough steps logged yet"
        if self.bound == "balanced":
            return "balanced: neither side waits for the other"
        return f"{self.bound}-bound: try {self.knobs[0]}"

    def html(self) -> str:
        ev = ", ".join(f"{k} {v:.3g}" for k, v in self.evidence.items())
        knobs = "".join(f"<li>{k}</li>" for k in self.knobs)
        notes = "".join(f"<li>{n}</li>" for n in self.notes)
        return (f"<b>Doctor: {self.headline}</b><br><small>{ev}</small>"
                + (f"<ol>{knobs}</ol>" if knobs else "") + (f"<ul>{notes}</ul>" if notes else ""))


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def _total(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]))


def training_rows(rows: list[dict]) -> list[dict]:
    """Logged optimizer steps (the end-of-training summary row aside)."""
    return [r for r in rows if "train_runtime" not in r and "perf/fwd_bwd_s" in r]


def diagnose(rows: list[dict], max_staleness: int, max_inflight_tasks: int | None = None,
             config: DoctorConfig | None = None) -> Verdict:
    """The regime of the last `config.window` logged steps (`loop_metrics.jsonl` rows or TRL log dicts)."""
    c = config or DoctorConfig()
    # the first step has no step time (nothing before it) and waits for the pipeline to fill: not a regime
    window = [r for r in training_rows(rows) if "perf/step_s" in r][-c.window:]
    step_s = _mean(window, "perf/step_s")
    if len(window) < 2 or step_s is None or step_s <= 0:
        return Verdict("unknown", [], {})
    wait = _mean(window, "perf/rollout_wait_s") or 0.0
    fwd_bwd = _mean(window, "perf/fwd_bwd_s") or 0.0
    sync = _mean(window, "perf/weight_sync_s") or 0.0
    queue = _mean(window, "sample/rollout_queue_size") or 0.0
    per_step = _mean(window, "batch/samples_per_step") or 1.0
    staleness = _mean(window, "sample/staleness_mean") or 0.0
    backpressure = _total(window, "rollout/backpressure_s")
    inflight = _mean(window, "rollout/inflight")
    consumed = _total(window, "batch/samples_per_step")
    wasted = _total(window, "sample/dropped_stale_total") + _total(window, "rollout/abandoned_groups_total") * max(
        (_mean(window, "batch/samples_per_step") or 0) / max(_mean(window, "batch/groups_per_step") or 1, 1), 1)
    evidence = {"step_s": step_s, "rollout_wait_frac": wait / step_s, "fwd_bwd_frac": fwd_bwd / step_s,
                "sync_frac": sync / step_s, "queue_steps": queue / per_step, "staleness_mean": staleness,
                "stale_frac": wasted / max(consumed + wasted, 1.0), "backpressure_s": backpressure}
    notes = []
    if sync / step_s >= c.sync_frac:
        notes.append(f"weight sync takes {100 * sync / step_s:.0f}% of a step: sync less often (weight_sync_steps) "
                     "or put adapters on faster storage")
    saturated = (inflight is not None and max_inflight_tasks
                 and inflight >= c.inflight_saturated * max_inflight_tasks)
    if max_staleness > 0 and staleness >= c.staleness_frac * max_staleness and evidence["stale_frac"] < c.stale_frac:
        wasted_now = "none is" if evidence["stale_frac"] == 0 else f"only {100 * evidence['stale_frac']:.1f}% is"
        notes.append(f"samples arrive {staleness:.1f} versions old on average (max_staleness {max_staleness}); "
                     f"{wasted_now} wasted so far, and TRL's importance ratio corrects the rest while it stays near 1")
    if evidence["stale_frac"] >= c.stale_frac:
        knobs = ["fewer samples waiting: lower max_inflight_tasks (or queue_maxsize) so rollouts are consumed "
                 "before they go stale",
                 f"a larger max_staleness (now {max_staleness}; each step up takes one more adapter slot: "
                 f"--max-loras {max_loras_for(max_staleness + 1)} for max_staleness {max_staleness + 1})",
                 "weight_sync_steps=1 if it is higher"]
        if evidence["rollout_wait_frac"] >= c.rollout_wait_frac and c.replicas_batch:
            knobs.insert(0, "more replicas: generation is slow and what it makes arrives stale")
        elif evidence["rollout_wait_frac"] >= c.rollout_wait_frac:
            # one request at a time: what is in flight beyond the replicas waits in their queues, aging
            knobs.insert(1, "more replicas, on cores the trainer does not use: generation is slow")
        return Verdict("staleness", knobs, evidence, notes)
    if evidence["rollout_wait_frac"] >= c.rollout_wait_frac and queue < c.queue_steps * per_step:
        if not c.replicas_batch:
            notes.append("these replicas serve one request at a time: a higher max_inflight_tasks would only "
                         "lengthen their queues (and the samples' staleness), not speed generation up")
            return Verdict("rollout", ["more replicas, on cores (or GPUs) the trainer does not use"], evidence, notes)
        knobs = ["more replicas (a GPU per vLLM replica)",
                 "a higher max_inflight_tasks (the public recipe went to 384) so each vLLM replica batches more"]
        if saturated:
            knobs.reverse()
        return Verdict("rollout", knobs, evidence, notes)
    if evidence["rollout_wait_frac"] <= c.train_wait_frac and (queue >= c.queue_steps * per_step or backpressure > 0):
        knobs = ["pack rows with token_budget (the public recipe: 16384) instead of a fixed sample count",
                 "turn gradient (activation) checkpointing off if the memory allows",
                 "loss_backend='grpo_lab' (no [tokens, vocab] logits: room for a larger token_budget)"]
        if sync / step_s >= c.sync_frac:
            knobs.insert(0, "weight_sync_steps > 1: syncing is a large share of each step")
        return Verdict("train", knobs, evidence, notes)
    return Verdict("balanced", [], evidence, notes)


def replica_notes(rows: list[dict], block_size: int | None = None, prompt_tokens: float | None = None) -> list[str]:
    """Per-replica load and prefix affinity from the router snapshots recorded beside the trainer's logs; with the
    replicas' KV `block_size` and the prompts' median length, a low affinity that the prompt length explains is said
    to be expected (only full blocks are shared: a prompt shorter than one block has no prefix to share)."""
    snaps = [r["router"] for r in rows if isinstance(r.get("router"), dict)]
    if len(snaps) < 2:
        return []
    delta = router_figures(snaps[-1], snaps[0])
    total = sum(v for k, v in delta.items() if k.endswith("_total"))
    notes = []
    if total > 0:
        affinity = delta["affinity_share"]
        note = (f"routing: {100 * affinity:.1f}% prefix affinity, "
                f"{100 * delta.get('unmatched_total', 0) / total:.1f}% unmatched, "
                f"{100 * delta.get('spilled_total', 0) / total:.1f}% spilled over {total:.0f} rollouts")
        if block_size and prompt_tokens is not None and prompt_tokens < block_size and affinity < 0.5:
            note += (f" — expected: the prompts (median {prompt_tokens:.0f} tokens) are shorter than one KV cache "
                     f"block ({block_size} tokens), so no prompt has a full block to share and the router cannot "
                     f"route by prefix; longer prompts (or replicas with smaller blocks) would show affinity")
        notes.append(note)
    loads: dict[str, list[float]] = {}
    for s in snaps:
        for url, n in (s.get("in_flight") or {}).items():
            loads.setdefault(url, []).append(float(n))
    if len(loads) > 1:
        means = {u: sum(v) / len(v) for u, v in loads.items()}
        avg = sum(means.values()) / len(means)
        if avg > 0 and max(means.values()) > 1.5 * avg:
            worst = max(means, key=means.get)
            notes.append(f"replica {worst} carries {means[worst]:.1f} in flight vs {avg:.1f} on average")
    return notes


# The settings a verdict depends on, as `run.json` names them, with what is assumed when a run did not record them.
RUN_DEFAULTS = {"replica_kind": "vllm", "max_staleness": DEFAULT_MAX_STALENESS, "max_inflight_tasks": None, "block_size": None,
                "prompt_tokens_median": None}


def judged_settings(record: dict | None, overrides: dict | None = None) -> tuple[dict, dict]:
    """The settings to judge a run by: the run's own record, then `overrides` (flags given), then the defaults;
    and where each came from ("run", "flag" or "default")."""
    settings, source = {}, {}
    for key, default in RUN_DEFAULTS.items():
        for origin, values in (("flag", overrides or {}), ("run", record or {})):
            if values.get(key) is not None:
                settings[key], source[key] = values[key], origin
                break
        else:
            settings[key], source[key] = default, "default"
    return settings, source


def find_run_record(path: str, levels: int = 3) -> tuple[dict | None, str | None]:
    """The `run.json` of the run `path` belongs to, and where it is: `path` may be the run's folder, a file in it,
    or a folder inside it (`<run>/runs`, `<run>/runs/<date_host>`: the TensorBoard logs transformers writes there),
    so the folder and up to `levels` folders above it are looked in."""
    folder = Path(path).absolute()
    if not folder.is_dir():
        folder = folder.parent
    for candidate in [folder, *folder.parents][:levels + 1]:
        record = read_run_record(candidate)
        if record is not None:
            return record, str(candidate / RUN_RECORD)
    return None, None


def replica_logs(record_path: str | None) -> list:
    """The replicas' log files of the run whose `run.json` is `record_path` (`<run>/logs`: local replicas write
    there, Ray replicas' output is copied there from their nodes), sorted; [] when there are none."""
    if record_path is None:
        return []
    folder = Path(record_path).parent / REPLICA_LOGS
    return sorted(p for p in folder.glob("*.log") if p.is_file()) if folder.is_dir() else []


def diagnose_run(rows: list[dict], record: dict | None, overrides: dict | None = None,
                 window: int = DoctorConfig.window) -> Verdict:
    """`diagnose` with the run's own settings (its `run.json`, then `overrides`), the replica and routing notes
    included."""
    s, _ = judged_settings(record, overrides)
    verdict = diagnose(rows, int(s["max_staleness"]), s["max_inflight_tasks"],
                       DoctorConfig.for_replicas(s["replica_kind"], window=window))
    verdict.notes = verdict.notes + replica_notes(rows, s["block_size"], s["prompt_tokens_median"])
    return verdict


@dataclass
class DoctorFlags:
    """`grpo-lab doctor`'s flags: which run a tracker's directory holds, and the settings that override the run's
    own (`run.json`), with `LoopSettings`' rules."""

    project: str | None = setting(None, help="the trackio project, when the directory holds several")
    run: str | None = setting(None, help="the trackio run (default: the newest)")
    max_staleness: int | None = like("max_staleness", default=None, help="override the run's max_staleness")
    max_inflight_tasks: int | None = like("max_inflight_tasks", default=None,
                                          help="override the run's requests in flight")
    window: int = setting(DoctorConfig.window, check=Range(2), help="judge the last this many steps")
    replica_kind: Literal[REPLICA_KINDS] | None = like("replica_kind", default=None, help=(
        "override the run's replica kind (cpu: one request at a time; vllm: batching)"))


def main(argv=None) -> int:
    """`grpo-lab doctor <run folder, loop_metrics.jsonl, trackio or TensorBoard directory>`: the verdict on a (running)
    loop, by its own settings."""
    import json
    import sys

    p = ConfigParser(DoctorFlags, "grpo-lab doctor", description=main.__doc__.split(":")[0] + ". The run's "
                     "settings come from its run.json; a flag given here overrides one.")
    p.add_argument("path", help="a run's output folder or its loop_metrics.jsonl; or a trackio directory "
                   "($TRACKIO_DIR, or a project's .db) or a TensorBoard log directory the run reported to")
    flags, a = p.parse(argv)
    from .progress import verdict_lines
    from .trackers import read_run

    try:
        rows, origin = read_run(a.path, flags.project, flags.run)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error} (run the loop with grpo-lab async-loop, which records loop_metrics.jsonl)",
              file=sys.stderr)
        return 2
    record, record_path = find_run_record(a.path)
    settings, source = judged_settings(record, asdict(flags))  # it reads the settings of RUN_DEFAULTS only
    verdict = diagnose_run(rows, record, asdict(flags), flags.window)
    print(verdict.headline)
    print(f"read from: {origin} ({len(training_rows(rows))} logged steps)" + (
        f"; settings from {record_path}" if record_path else ""))
    print("judged with: " + ", ".join(f"{k} {settings[k]} ({source[k]})" for k in
                                      ("replica_kind", "max_staleness", "max_inflight_tasks")))
    if record is None:
        print("  note: this run has no run.json (recorded by grpo-lab async-loop): defaults were assumed")
    logs = replica_logs(record_path)
    if logs:
        print(f"replica logs: {logs[0].parent} ({', '.join(p.name for p in logs)})")
    print("evidence: " + json.dumps({k: round(v, 4) for k, v in verdict.evidence.items()}))
    print("\n".join(verdict_lines(verdict)[1:]))  # the knobs and notes (the headline came first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
