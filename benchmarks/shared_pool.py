"""Several async-loop runs on one shared pool vs each run on its own pool of the same total replica count.

For N runs (2 and 3 by default) it measures two set-ups with N CPU replicas in all, on the embedded task:

- **shared**: one `SharedPool` (`grpo-lab serve-pool`) of N replicas; N `grpo-lab async-loop --router-url POOL
  --run-name rI` processes join it (each its own namespace, token, adapter slots and fair share);
- **separate**: N `grpo-lab async-loop --replicas 1` processes, each with its own replica and router.

All runs of a set-up start together. Per run: steps/s and trained tokens/s over its training window (first logged
step to last: the imports and start-up, the same in both set-ups, are left out), and the doctor's verdict on it
(judged by its own run.json). Per set-up: total trained tokens/s (the runs' rates summed: they train at the same time)
and Jain's fairness index of the runs' steps/s, (sum x)^2 / (N sum x^2): 1 when every run goes at the same pace, 1/N
when one run gets everything. Writes `<out>/shared_pool.csv` (one row per run, machine and versions in columns),
`shared_pool.md` (the table, machine, versions, date) and `shared_pool.png`.

    python benchmarks/shared_pool.py --runs 2 3 --steps 10 --out results/async
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd


def _command(out: Path, steps: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "grpo_lab.cli", "async-loop", "--output-dir", str(out), "--max-steps", str(steps),
            "--save-steps", "100000", *extra]


def _run_all(commands: dict[str, list[str]], folder: Path, timeout: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = {}
    try:
        for name, cmd in commands.items():
            log = open(folder / f"{name}.log", "w")
            procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True), log)
        deadline = time.monotonic() + timeout
        for name, (proc, log) in procs.items():
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            if code != 0:
                raise RuntimeError(f"run {name} failed ({code}): {(folder / f'{name}.log').read_text()[-2000:]}")
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            log.close()


def _measure(out: Path) -> dict:
    from grpo_lab.async_loop.doctor import diagnose_run
    from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
    from grpo_lab.async_loop.run_dir import read_run_record

    rows = [r for r in read_metrics(out / METRICS_FILE) if "train_runtime" not in r]
    span = rows[-1]["time"] - rows[0]["time"]
    tokens = sum(r.get("batch/trained_tokens_per_step", 0.0) for r in rows[1:])  # those trained inside the span
    verdict = diagnose_run(rows, read_run_record(out) or {})
    return {"steps": len(rows), "window_s": round(span, 2), "steps_per_s": (len(rows) - 1) / span,
            "trained_tok_s": tokens / span, "reward_last": rows[-1].get("reward"),
            "doctor_bound": verdict.bound, "doctor_headline": verdict.headline}


def shared(n: int, steps: int, root: Path, timeout: float, in_flight: int | None = None) -> list[dict]:
    from grpo_lab.async_loop.serve_pool import PoolConfig, SharedPool
    from grpo_lab.serving.adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for

    config = PoolConfig(replicas=n, state_dir=str(root / "pool"), max_in_flight_per_replica=in_flight,
                        adapter_slots=n * max_loras_for(DEFAULT_MAX_STALENESS))
    with SharedPool(config) as pool:
        _run_all({f"r{i}": _command(root / f"r{i}", steps, ["--router-url", pool.url, "--run-name", f"r{i}",
                                                             "--pool-admin-key-file", pool.admin_key_file])
                  for i in range(n)}, root, timeout)
        runs = {r["name"] for r in pool.runs()}
        assert not runs, f"runs still registered after they ended: {runs}"
    return [{"setup": "shared", "runs": n, "replicas": n, "run": f"r{i}", **_measure(root / f"r{i}")}
            for i in range(n)]


def separate(n: int, steps: int, root: Path, timeout: float, in_flight: int | None = None) -> list[dict]:
    _run_all({f"r{i}": _command(root / f"r{i}", steps, ["--replicas", "1"]) for i in range(n)}, root, timeout)
    return [{"setup": "separate", "runs": n, "replicas": n, "run": f"r{i}", **_measure(root / f"r{i}")}
            for i in range(n)]


def markdown(frame: pd.DataFrame) -> str:
    """A GitHub table (pandas' to_markdown needs tabulate, which grpo-lab does not install)."""
    cells = [[str(v) for v in frame.columns]] + [[str(v) for v in row] for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join([lines[0], "|" + "---|" * len(frame.columns), *lines[1:]])


def jain(values) -> float:
    values = list(values)
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    groups = frame.groupby(["runs", "setup"], sort=False)
    return pd.DataFrame({
        "total_trained_tok_s": groups["trained_tok_s"].sum().round(1),
        "steps_per_s_each": groups["steps_per_s"].apply(lambda s: " / ".join(f"{v:.3f}" for v in s)),
        "jain_fairness": groups["steps_per_s"].apply(jain).round(3),
        "doctor": groups["doctor_bound"].apply(lambda s: " / ".join(s)),
    }).reset_index()


def plot(frame: pd.DataFrame, summary: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [f"{r.runs} runs\n{r.setup}" for r in summary.itertuples()]
    colors = ["tab:blue" if r.setup == "shared" else "tab:gray" for r in summary.itertuples()]
    left.bar(labels, summary["total_trained_tok_s"], color=colors)
    for x, r in enumerate(summary.itertuples()):
        left.text(x, r.total_trained_tok_s, f"J={r.jain_fairness:.2f}", ha="center", va="bottom", fontsize=8)
    left.set_ylabel("total trained tokens/s")
    left.set_title("throughput (J: Jain's fairness of steps/s)")
    x = 0
    ticks = []
    for r in summary.itertuples():
        each = frame[(frame.runs == r.runs) & (frame.setup == r.setup)]["steps_per_s"].tolist()
        for i, v in enumerate(each):
            right.bar(x + i * 0.8 / len(each), v, width=0.8 / len(each),
                      color="tab:blue" if r.setup == "shared" else "tab:gray", edgecolor="white")
        ticks.append(x + 0.4 - 0.4 / len(each))
        x += 1
    right.set_xticks(ticks, labels)
    right.set_ylabel("steps/s of each run")
    right.set_title("each run's pace")
    fig.suptitle("N async-loop runs: one shared pool of N CPU replicas vs N pools of 1 (embedded task)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, nargs="+", default=[2, 3])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default="results/async")
    p.add_argument("--setups", nargs="+", choices=("shared", "separate"), default=["shared", "separate"])
    p.add_argument("--max-in-flight-per-replica", type=int, default=None,
                   help="the shared pool's cap per replica (default: serve-pool's, 4 for CPU replicas)")
    a = p.parse_args(argv)
    from grpo_lab.lab.records import run_record

    rows = []
    for n in a.runs:
        for setup in [{"shared": shared, "separate": separate}[name] for name in a.setups]:
            root = Path(tempfile.mkdtemp(prefix=f"grpo-lab-shared-pool-{setup.__name__}-{n}-"))
            t0 = time.perf_counter()
            rows += setup(n, a.steps, root, a.timeout, a.max_in_flight_per_replica)
            print(f"{setup.__name__} x{n}: {time.perf_counter() - t0:.0f}s", flush=True)
    frame = pd.DataFrame(rows)
    record = run_record("cpu")
    summary = summarize(frame)
    print(summary.to_string(index=False))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for key, value in record.items():
        frame[key] = value
    frame.to_csv(out / "shared_pool.csv", index=False)
    plot(frame, summary, out / "shared_pool.png")
    machine = ", ".join(f"{k} {v}" for k, v in record.items())
    (out / "shared_pool.md").write_text(
        "# Shared pool vs a pool per run (benchmarks/shared_pool.py)\n\n"
        f"`python benchmarks/shared_pool.py --runs {' '.join(map(str, a.runs))} --steps {a.steps}`: the embedded "
        "task, `grpo-lab async-loop` defaults (2 prompts x 8 rollouts a step, max_staleness 4, LoRA r=1), CPU "
        "replicas with 1 torch thread, every run of a set-up started at once. Total trained tokens/s sums the runs' "
        "rates over their training windows; Jain's index is over the runs' steps/s.\n\n"
        + markdown(summary) + "\n\n" + f"Machine and versions: {machine}.\n\n"
        + "Per run (`shared_pool.csv`):\n\n"
        + frame[["runs", "setup", "run", "steps", "window_s", "steps_per_s", "trained_tok_s", "doctor_bound",
                 "doctor_headline"]].round(3).pipe(markdown) + "\n")
    print("wrote", out / "shared_pool.csv", out / "shared_pool.md", out / "shared_pool.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
