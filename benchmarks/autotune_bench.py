"""Does autotune work? The embedded CPU loop under TRL's default, a grid of hand-set in-flight/queue settings,
autotune from TRL's default, and autotune from two bad starts (1 in flight, 512 in flight), each to the same steps.

    .venv/bin/python benchmarks/autotune_bench.py                 # ~20 min on a 2-core CPU (3 rounds of 60 steps)
    .venv/bin/python benchmarks/autotune_bench.py --steps 10 --rounds 1 --only trl_default,autotune   # a quick look

Writes `results/async/autotune.csv` (one row per run and round: steps/s, trained tokens/s, wasted-sample share,
staleness, the final in-flight count, machine and versions), `autotune_summary.csv` (each setting's mean over the
rounds, and autotune against the best hand-set setting and TRL's default) and `autotune.png`. Steps/s is measured
from the end of step 1 to the end of the last step (step 1 waits for the pipeline to fill, the same for every run);
`late_steps_per_s` is the last third of the run, where a controller that started badly should have recovered.
The settings run in rounds (every setting once, then again), so a slow spell of a shared machine falls on all of
them rather than on one; on a 2-core VM the same setting's steps/s varies by up to 15 % from run to run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (max_inflight_tasks, queue_maxsize, autotune); -1 in flight is TRL's default, max(S, 1) x samples per step
RUNS = {
    "trl_default": (-1, 1024, False),
    "hand_4_16": (4, 16, False),
    "hand_8_16": (8, 16, False),
    "hand_16_16": (16, 16, False),
    "hand_16_64": (16, 64, False),
    "hand_32_32": (32, 32, False),
    "hand_64_64": (64, 64, False),
    "autotune": (-1, 1024, True),
    "autotune_from_1": (1, 1024, True),
    "autotune_from_512": (512, 1024, True),
}


def summarise(rows: list[dict], num_generations: int) -> dict:
    steps = [r for r in rows if "train_runtime" not in r and "perf/fwd_bwd_s" in r]
    times = [r["time"] for r in steps]
    n = len(steps)
    third = max(n // 3, 2)
    consumed = sum(r.get("batch/samples_per_step") or 0 for r in steps)
    wasted = sum((r.get("sample/dropped_stale_total") or 0)
                 + (r.get("rollout/abandoned_groups_total") or 0) * num_generations for r in steps)
    tokens = sum(r.get("batch/trained_tokens_per_step") or 0 for r in steps[1:])
    staleness = [r["sample/staleness_mean"] for r in steps if r.get("sample/staleness_mean") is not None]
    changes = [d for r in steps for d in r.get("autotune", [])]
    return {
        "steps": n,
        "steps_per_s": (n - 1) / (times[-1] - times[0]),
        "late_steps_per_s": (third - 1) / (times[-1] - times[-third]),
        "trained_tok_s": tokens / (times[-1] - times[0]),
        "wasted_share": wasted / max(consumed + wasted, 1),
        "staleness_mean": sum(staleness) / max(len(staleness), 1),
        "staleness_max": max((r.get("sample/staleness_max") or 0) for r in steps),
        "rollout_wait_share": sum(r.get("perf/rollout_wait_s") or 0 for r in steps[1:])
        / max(sum(r.get("perf/step_s") or 0 for r in steps[1:]), 1e-9),
        "final_inflight": steps[-1].get("autotune/inflight"),
        "final_queue_bound": steps[-1].get("autotune/queue_bound"),
        "autotune_changes": len(changes),
        "inflight_trace": json.dumps([r.get("autotune/inflight") for r in steps]) if changes or
        steps[-1].get("autotune/inflight") else "",
    }


def run_one(name: str, steps: int, workdir: Path, replica_threads: int = 0) -> dict:
    from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
    from grpo_lab.async_loop.recorder import read_metrics

    inflight, queue, autotune = RUNS[name]
    out = workdir / name
    shutil.rmtree(out, ignore_errors=True)
    args = embedded_trainer_args(str(out), max_steps=steps, save_strategy="no", max_inflight_tasks=inflight,
                                 queue_maxsize=queue)
    t0 = time.perf_counter()
    extra = {"replica_threads": replica_threads} if replica_threads else {}
    with AsyncLoop(LoopConfig(replicas=2, autotune=autotune, **extra), args, progress=False) as loop:
        loop.train()
    wall = time.perf_counter() - t0
    from grpo_lab.async_loop.config import inflight_tasks

    rows = read_metrics(out / "loop_metrics.jsonl")
    summary = summarise(rows, args.num_generations)
    start = inflight_tasks(inflight, args.max_staleness, args.per_device_train_batch_size)
    return {"run": name, "start_inflight": start, "queue_maxsize": queue, "autotune": autotune, "wall_s": wall,
            **summary}


def figure(frame, summary, path: Path, machine: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["tab:gray" if r == "trl_default" else "tab:green" if r.startswith("autotune") else "tab:blue"
              for r in summary["run"]]
    ax1.barh(summary["run"], summary["steps_per_s"], color=colors)
    for y, name in enumerate(summary["run"]):
        ax1.plot(frame.loc[frame["run"] == name, "steps_per_s"], [y] * int((frame["run"] == name).sum()), "k.",
                 markersize=4)
    for y, (v, top, w) in enumerate(zip(summary["steps_per_s"], summary["steps_per_s_max"], summary["wasted_share"])):
        ax1.text(top, y, f"  {v:.2f} ({100 * w:.0f}% wasted)", va="center", fontsize=8)
    ax1.set_xlim(0, summary["steps_per_s_max"].max() * 1.45)
    ax1.set_xlabel("steps/s, mean of the rounds (dots: each round)\ngray: TRL default, blue: hand-set, green: "
                   "autotune")
    ax1.invert_yaxis()
    last = frame[frame["round"] == frame["round"].max()]
    for _, r in last[last["autotune"]].iterrows():
        trace = json.loads(r["inflight_trace"]) if r["inflight_trace"] else []
        ax2.plot(range(1, len(trace) + 1), trace, marker=".", label=r["run"])
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("step")
    ax2.set_ylabel("requests in flight (autotune, last round)")
    if ax2.get_legend_handles_labels()[0]:  # no autotune run among those chosen (--only): no legend to draw
        ax2.legend(fontsize=8)
    fig.suptitle(f"autotune on the embedded loop (2 replicas){': ' + machine if machine else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of every run (at least 2: steps/s is "
                   "measured from the end of step 1)")
    p.add_argument("--rounds", type=int, default=3, help="times each setting runs (interleaved); the verdict is "
                   "on the means")
    p.add_argument("--replica-threads", type=int, default=0, help="threads per CPU replica (0: the loop's default)")
    p.add_argument("--name", default="autotune", help="file stem of the outputs (autotune -> autotune.csv, ...)")
    p.add_argument("--merge", nargs="+", default=None, metavar="CSV",
                   help="run nothing: merge these per-round CSVs (e.g. one per device call) into --name's files")
    p.add_argument("--only", default="", help=f"comma-separated run names, of: {', '.join(RUNS)} (empty: all)")
    p.add_argument("--out", default=str(ROOT / "results" / "async"))
    p.add_argument("--keep", default=None, help="keep each run's folder (its loop_metrics.jsonl) here")
    a = p.parse_args(argv)
    names = [n for n in a.only.split(",") if n] if a.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"--only: unknown run {', '.join(unknown)} (runs: {', '.join(RUNS)})")
    if not a.merge and (a.steps < 2 or a.rounds < 1):
        p.error(f"--steps must be >= 2 and --rounds >= 1, got {a.steps} and {a.rounds}")
    import pandas as pd

    if importlib.util.find_spec("grpo_lab") is None:  # an installed grpo_lab (with its data files) comes first
        sys.path.insert(0, str(ROOT))
    from grpo_lab.lab.records import run_record

    if a.merge:
        return merge_rounds([Path(f) for f in a.merge], Path(a.out), a.name)
    workdir = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="grpo-lab-autotune-"))
    results = []
    try:
        for round_ in range(1, a.rounds + 1):
            for name in names:
                result = {"round": round_, **run_one(name, a.steps, workdir, a.replica_threads)}
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()
                                  if k != "inflight_trace"}), flush=True)
                results.append({**result, **run_record("auto")})  # the load each run left, its time
            if round_ < a.rounds:  # a run cut short (Ctrl-C, a time limit) keeps every round it finished
                write_outputs(pd.DataFrame(results), Path(a.out), a.name, quiet=True)
                print(f"round {round_}/{a.rounds} written to {Path(a.out) / a.name}.csv", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return write_outputs(pd.DataFrame(results), Path(a.out), a.name)


def merge_rounds(paths: list[Path], out: Path, name: str) -> int:
    """One CSV, summary and figure from per-round CSVs (each file's rounds numbered after the previous file's)."""
    import pandas as pd

    frames, offset = [], 0
    for path in paths:
        frame = pd.read_csv(path, keep_default_na=False, na_values=[""])
        frame["round"] = frame["round"] + offset
        offset = int(frame["round"].max())
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True)
    frame["inflight_trace"] = frame["inflight_trace"].fillna("")
    return write_outputs(frame, out, name)


def write_outputs(frame, out: Path, name: str, quiet: bool = False) -> int:
    """The per-run CSV, the summary (with the machine and versions of the last run) and the figure; the verdict
    (unless `quiet`: the files written after each round of a longer run)."""
    from grpo_lab.lab.records import run_record

    summary = summarise_rounds(frame)
    for key in run_record("cpu"):  # the record's columns, valued as the runs recorded them
        if key in frame:
            summary[key] = frame[key].iloc[-1]
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / f"{name}.csv", index=False)
    summary.to_csv(out / f"{name}_summary.csv", index=False)
    figure(frame, summary, out / f"{name}.png", str(summary["machine"].iloc[-1]) if "machine" in summary else "")
    if quiet:
        return 0
    for line in verdict_lines(summary):
        print(line)
    print(f"wrote {out / f'{name}.csv'}, {out / f'{name}_summary.csv'} and {out / f'{name}.png'}")
    return 0


def summarise_rounds(frame):
    """Each setting's mean over the rounds; for the autotune runs, their ratios to the best hand-set setting (by
    mean steps/s) and to TRL's default."""
    keys = ["steps_per_s", "late_steps_per_s", "trained_tok_s", "wasted_share", "staleness_mean",
            "rollout_wait_share"]
    summary = frame.groupby("run", sort=False).agg(
        start_inflight=("start_inflight", "first"), queue_maxsize=("queue_maxsize", "first"),
        autotune=("autotune", "first"), rounds=("round", "count"), **{k: (k, "mean") for k in keys},
        steps_per_s_min=("steps_per_s", "min"), steps_per_s_max=("steps_per_s", "max"),
        final_inflight=("final_inflight", "last")).reset_index()
    hand = summary[summary["run"].str.startswith("hand_")]
    if len(hand) and "trl_default" in set(summary["run"]):
        best = hand.loc[hand["steps_per_s"].idxmax()]
        default = float(summary.loc[summary["run"] == "trl_default", "steps_per_s"].iloc[0])
        summary["best_hand_set"] = best["run"]
        summary["x_best_hand_set"] = summary["steps_per_s"] / best["steps_per_s"]
        summary["late_x_best_hand_set"] = summary["late_steps_per_s"] / best["steps_per_s"]
        summary["x_trl_default"] = summary["steps_per_s"] / default
    return summary


def verdict_lines(summary) -> list[str]:
    """The issue's bars, said for each autotune run: >= 0.9x the best hand-set steps/s, <= 5 % wasted, no more than
    3 % slower than TRL's default (from TRL's default), and the last third within 10 % of the best (bad starts)."""
    if "x_best_hand_set" not in summary:
        return []
    lines = []
    for _, r in summary[summary["autotune"]].iterrows():
        lines.append(f"{r['run']}: {r['x_best_hand_set']:.2f}x the best hand-set ({r['best_hand_set']}), "
                     f"{r['x_trl_default']:.2f}x TRL's default, last third {r['late_x_best_hand_set']:.2f}x the "
                     f"best, wasted {100 * r['wasted_share']:.1f}% (mean of {r['rounds']} rounds)")
    return lines


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
