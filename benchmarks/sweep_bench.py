"""Does sharing one replica pool pay? The same K runs of a sweep (a) as tenants of one pool of R replicas and (b) each
with its own pool of R/K replicas (same replicas in total), side by side on one machine.

    python benchmarks/sweep_bench.py --runs 4 --replicas 4 --steps 20 --grid mixed --seeds 2 --pin

`--grid same` gives the K runs the same work (learning rates differ); `--grid mixed` varies `num_generations`, so
runs need different amounts of generation, as a real grid does. With `--pin` (Linux) each replica is pinned to a core
of its own and the trainers, rollout workers and routers share the remaining cores, so replicas do not fight the
trainers for CPU (the GPU machine's host has 16 cores; a 2-core VM measures contention, not sharing).

Per run it records the wall time (its process's start to end), the start-up (to its first step: imports, CUDA, the
trainer, joining the pool), its steady steps/s after that, steps, trained tokens and final reward (the mean of its
last steps); per layout the makespan (first start to last end) and the trained tokens per second of all runs.
Printed and written to `<out>/sweep_bench.csv` (one row per layout, seed and run) and `sweep_bench_summary.csv`:
makespan shared / separate, each run's slowdown (its wall time shared over separate: the separate layout is the run
alone on its share of the replicas), the p99 over runs, Jain's fairness index of the runs' speeds (separate over
shared wall time), the same two past start-up (steady steps/s) and, with `--seeds` >= 2, whether each run's shared
final reward lies within the seed-to-seed spread of its separate runs. Every row carries the machine, versions and
date (`grpo_lab.lab.records`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
try:  # an installed grpo_lab (the GPU machine's, with its data files) first; else this checkout
    import grpo_lab  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

from grpo_lab.lab.records import run_record
from grpo_lab.sweep import Sweep, SweepConfig
from grpo_lab.sweep.figures import CURVES, mean_of_last, step_rows

# where a step's time goes, averaged per run past its first step: waiting for rollouts, publishing the adapter
# (the router's all-or-nothing load on every replica), a rollout's own time, the samples' age
WHERE_TIME_GOES = {"rollout_wait_s": "perf/rollout_wait_s", "weight_sync_s": "perf/weight_sync_s",
                   "rollout_s": "rollout/duration_s", "staleness": "sample/staleness_mean", "step_s": "perf/step_s"}
GRIDS = {  # K runs' grid by name: the values are cut to --runs
    "same": ("learning_rate", [5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]),
    "mixed": ("num_generations", [2, 4, 8, 16, 6, 12]),
}


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when every value is equal, 1/n when one value takes everything."""
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values else math.nan


def pin_replicas(pool, first_core: int) -> list[int]:
    """Pin each replica process of `pool` (and its threads) to a core of its own from `first_core` on."""
    import psutil

    cores = []
    for i, replica in enumerate(pool.cluster.replicas):
        core = first_core + i
        for proc in [psutil.Process(replica.pid), *psutil.Process(replica.pid).children(recursive=True)]:
            proc.cpu_affinity([core])
        cores.append(core)
    return cores


def replica_work(pool) -> dict:
    """The pool's replicas' time per kind of work, summed (`grpo_replica_work_*`): what generation got and what
    adapter loads and unloads took."""
    import requests

    from grpo_lab.serving.wire.metrics import parse_text

    totals: dict = {}
    for replica in pool.cluster.replicas:
        values = parse_text(requests.get(replica.url + "/metrics", timeout=10).text)
        for key, value in values.items():
            name, _, label = key.partition('{work="')
            if name in ("grpo_replica_work_total", "grpo_replica_work_seconds_total"):
                column = "replica_" + label.rstrip('"}') + ("_s" if name.endswith("seconds_total") else "_n")
                totals[column] = totals.get(column, 0.0) + value
    return {k: round(v, 2) for k, v in totals.items()}


def run_layout(layout: str, setting: str, values: list, base: dict, replicas: int, out: Path, env: dict,
               pin_from: int | None, replica_threads: int) -> list[dict]:
    """Run one run per value of `setting` in `layout` ('shared': one pool of `replicas`; 'separate': a pool of
    `replicas / runs` each, all at once); one record per run."""
    pool_fields = {"replica_threads": replica_threads}
    if layout == "shared":
        sweeps = [Sweep(SweepConfig(base=base, grid={setting: values}, replicas=replicas, parallel=len(values),
                                    pool=pool_fields, out_dir=str(out / "shared")), env=env)]
    else:
        sweeps = [Sweep(SweepConfig(base=base, grid={setting: [v]}, replicas=replicas // len(values), parallel=1,
                                    pool=pool_fields, out_dir=str(out / f"separate-{i}")), env=env)
                  for i, v in enumerate(values)]
    started = time.time()
    starting = [threading.Thread(target=sweep.start) for sweep in sweeps]  # the pools start side by side
    for thread in starting:
        thread.start()
    for thread in starting:
        thread.join()
    if any(sweep.pool is None for sweep in sweeps):
        for sweep in sweeps:
            sweep.close()
        raise RuntimeError(f"a pool of the {layout} layout did not start (see the sweeps' folders under {out})")
    if pin_from is not None:
        core = pin_from
        for sweep in sweeps:
            core += len(pin_replicas(sweep.pool, core))
    work = {}
    try:
        for sweep in sweeps:
            sweep.wait()
        work = {sweep: replica_work(sweep.pool) for sweep in sweeps}
    finally:
        for sweep in sweeps:
            sweep.close()
    records = []
    for sweep in sweeps:
        for run in sweep.runs.values():
            rows = step_rows(run.output_dir)
            wall = (run.ended_at or math.nan) - (run.started_at or math.nan)
            tokens = sum(r.get("batch/trained_tokens_per_step", 0) for r in rows)
            # past the first step: start-up (imports, CUDA, the trainer, joining the pool) is behind the run
            steady = ((len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"])
                      if len(rows) > 1 and rows[-1]["time"] > rows[0]["time"] else math.nan)
            records.append({"layout": layout, "run": f"{setting}={run.settings[setting]}", "status": run.status,
                            "steps": len(rows), "wall_s": round(wall, 2), "trained_tokens": int(tokens),
                            "startup_s": round(rows[0]["time"] - run.started_at, 2) if rows else math.nan,
                            "steady_steps_per_s": round(steady, 3),
                            "final_reward": mean_of_last(rows, CURVES["reward"]),
                            **{name: round(mean_of_last(rows[1:], key, last=len(rows)), 3)
                               for name, key in WHERE_TIME_GOES.items()},
                            "started_at": run.started_at, "ended_at": run.ended_at,
                            "layout_started_at": started, **work.get(sweep, {})})
    return records


def pool_work(rows: pd.DataFrame, layout: str) -> dict:
    """The layout's replica time, summed over its pools: one shared pool (each of its runs' rows repeats it), or
    one pool per run. Columns: replica seconds generating and on adapter loads plus unloads, and the loads done."""
    pools = rows.iloc[:1] if layout == "shared" else rows

    def total(column):
        return float(pools[column].sum()) if column in pools else math.nan
    adapter_s = total("replica_adapter_load_s") + total("replica_adapter_unload_s")
    return {f"generate_s_{layout}": round(total("replica_generate_s"), 1), f"adapter_s_{layout}": round(adapter_s, 1),
            f"adapter_loads_{layout}": total("replica_adapter_load_n")}


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per seed: makespans, trained tokens/s, slowdown per run and its p99, Jain's index, reward check."""
    out = []
    for seed, rows in frame.groupby("seed"):
        shared = rows[rows.layout == "shared"].set_index("run")
        separate = rows[rows.layout == "separate"].set_index("run")
        span = {name: part.ended_at.max() - part.started_at.min() for name, part in (("shared", shared),
                                                                                      ("separate", separate))}
        # past start-up (imports, CUDA, the trainer, joining: the same in both layouts): first step to last end
        trained = {name: part.ended_at.max() - (part.started_at + part.startup_s).min()
                   for name, part in (("shared", shared), ("separate", separate))}
        slowdown = (shared.wall_s / separate.wall_s).dropna()
        steady = (separate.steady_steps_per_s / shared.steady_steps_per_s).dropna()  # past start-up
        out.append({"seed": seed, "runs": len(shared), "makespan_shared_s": round(span["shared"], 1),
                    "makespan_separate_s": round(span["separate"], 1),
                    "makespan_ratio": round(span["shared"] / span["separate"], 3),
                    "training_span_ratio": round(trained["shared"] / trained["separate"], 3),
                    "tok_s_shared": round(shared.trained_tokens.sum() / span["shared"], 1),
                    "tok_s_separate": round(separate.trained_tokens.sum() / span["separate"], 1),
                    "p99_slowdown": round(float(slowdown.quantile(0.99)), 3) if len(slowdown) else math.nan,
                    "worst_run": slowdown.idxmax() if len(slowdown) else "",
                    "jain": round(jain(list(1.0 / slowdown)), 3) if len(slowdown) else math.nan,
                    "p99_steady_slowdown": round(float(steady.quantile(0.99)), 3) if len(steady) else math.nan,
                    "jain_steady": round(jain(list(1.0 / steady)), 3) if len(steady) else math.nan,
                    **pool_work(shared, "shared"), **pool_work(separate, "separate")})
    summary = pd.DataFrame(out)
    seeds = frame.seed.nunique()
    if seeds >= 2:  # shared reward within the separate runs' seed-to-seed spread, run by run
        sep = frame[frame.layout == "separate"].groupby("run").final_reward.agg(["min", "max"])
        shr = frame[frame.layout == "shared"].groupby("run").final_reward.agg(["min", "max"])
        spread = sep["max"] - sep["min"]
        inside = (shr["min"] >= sep["min"] - spread) & (shr["max"] <= sep["max"] + spread)
        summary["rewards_within_spread"] = f"{int(inside.sum())}/{len(inside)}"
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grid", choices=sorted(GRIDS), default="mixed")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=1, help="seeds run are first-seed .. first-seed+seeds-1 "
                        "(so the seeds of one comparison can be split over several device calls)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="CSV",
                        help="run nothing: summarize the per-run CSVs of earlier calls together into --name")
    parser.add_argument("--replica-threads", type=int, default=1)
    parser.add_argument("--pin", action="store_true", help="a core per replica (from core 0); the rest for the runs")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "sweep")
    parser.add_argument("--work", type=Path, default=None, help="where the sweeps' folders go (default: a new one "
                        "under outputs/sweep_bench)")
    parser.add_argument("--name", default="sweep_bench")
    args = parser.parse_args(argv)
    if args.merge:  # nothing runs, so nothing else is checked or pinned
        return write_summary(pd.concat([pd.read_csv(path) for path in args.merge]), args)
    if args.replicas % args.runs:
        parser.error(f"--replicas ({args.replicas}) must be a multiple of --runs ({args.runs}): the separate layout "
                     "gives each run the same share")
    setting, values = GRIDS[args.grid]
    if args.runs > len(values):
        parser.error(f"--runs at most {len(values)} for --grid {args.grid}")
    values = values[: args.runs]
    work = args.work or ROOT / "outputs" / "sweep_bench" / time.strftime("%Y%m%d-%H%M%S")
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pin_from = None
    if args.pin:
        total = os.cpu_count() or 1
        if total < args.replicas + 2:
            parser.error(f"--pin needs more cores than replicas: {total} cores, {args.replicas} replicas")
        os.sched_setaffinity(0, set(range(args.replicas, total)))  # the runs (children inherit it), routers
        pin_from = 0
    records = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        base = {"max_steps": args.steps, "seed": seed}
        for layout in ("shared", "separate"):  # one after the other, never at once
            print(f"seed {seed}: {layout} ...", flush=True)
            got = run_layout(layout, setting, values, base, args.replicas, work / f"seed{seed}", env, pin_from,
                             args.replica_threads)
            for r in got:
                print(f"  {r['run']}: {r['status']}, {r['steps']} steps in {r['wall_s']} s ({r['startup_s']} s to the "
                      f"first step, then {r['steady_steps_per_s']} steps/s), reward {r['final_reward']:.3f}; per step "
                      f"{r['step_s']} s: rollout wait {r['rollout_wait_s']} s, weight sync {r['weight_sync_s']} s",
                      flush=True)
            records += [{**r, "seed": seed, "grid": args.grid, "replicas": args.replicas} for r in got]
            args.out.mkdir(parents=True, exist_ok=True)  # after every layout: a run cut short keeps what it measured
            pd.DataFrame(records).assign(**run_record()).to_csv(args.out / f"{args.name}.csv", index=False)
    return write_summary(pd.DataFrame(records), args)


def write_summary(frame: pd.DataFrame, args: argparse.Namespace) -> int:
    """Summarize per-run records (this call's, or merged CSVs') into `<out>/<name>_summary.csv` and print it."""
    summary = summarize(frame)
    record = run_record()  # merged CSVs keep the machine, versions and date they were measured with
    record = {key: frame[key].iloc[0] if key in frame else value for key, value in record.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    summary.assign(grid=frame.grid.iloc[0], replicas=frame.replicas.iloc[0], steps=int(frame.steps.max()),
                   **record).to_csv(args.out / f"{args.name}_summary.csv", index=False)
    print(summary.to_string(index=False))
    print(f"wrote {args.out / (args.name + '_summary.csv')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
