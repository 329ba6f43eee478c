"""Replay the committed H200 max-batch probes through the current search: how many probes would it need?

Each finished (model, backend) search of `results/fsdp_max_batch/fsdp_max_batch_probes.csv` becomes a memory model: fits iff B is at
most the largest batch that fitted there; allocated and reserved peaks are the least-squares lines through the
fitted probes above the start; the start probe keeps its measured peaks. The CSV has no setup memory for those
runs, so it is back-solved from the first version's first guess (the second probe it made). Prints, per search,
the probes the H200 run took and the ones the current search takes, with its answer. A model, not a measurement:
it says how the search behaves on memory that grows like the measured one.

    python benchmarks/search_replay.py [--probes results/fsdp_max_batch/fsdp_max_batch_probes.csv]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from grpo_lab.memory.max_batch import search_max_batch

GiB = 2**30


def replay(probes: pd.DataFrame, budget_gib: float, start: int, upper: int, rel_tol: float) -> pd.DataFrame:
    budget, rows = budget_gib * GiB, []
    for (model, backend), g in probes.groupby(["model", "backend"], sort=False):
        ok = g[g["status"] == "ok"]
        big = ok[ok["batch_size"] > start]
        if len(big) < 2:
            continue
        limit = int(ok["batch_size"].max())
        alloc = np.polyfit(big["batch_size"], big["peak_gib"], 1)
        reserved = np.polyfit(big["batch_size"], big["reserved_gib"], 1)
        first = ok[ok["batch_size"] == start].iloc[0]
        second = int(g["batch_size"].iloc[1])  # the first version's guess from the start probe alone
        peak0 = first["peak_gib"] * GiB
        setup = (budget - second * peak0 / start) / (1 - second / start)

        def fits(b, first=first, limit=limit, alloc=alloc, reserved=reserved, setup=setup, peak0=peak0):
            if b == start:
                return True, {"peak_bytes": peak0, "reserved_bytes": first["reserved_gib"] * GiB,
                              "setup_bytes": setup, "base_bytes": 0}
            return b <= limit, {"peak_bytes": np.polyval(alloc, b) * GiB,
                                "reserved_bytes": np.polyval(reserved, b) * GiB, "setup_bytes": setup, "base_bytes": 0}

        res = search_max_batch(fits, start=start, upper=upper, rel_tol=rel_tol, budget=budget)
        rows.append({"model": model, "backend": backend, "h200_probes": len(g), "replay_probes": len(res.probes),
                     "h200_max": limit, "replay_max": res.max_batch, "capped": res.capped,
                     "replay": " ".join(f"{b}:{s}" for b, s in res.probes)})
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probes", default="results/fsdp_max_batch/fsdp_max_batch_probes.csv")
    p.add_argument("--budget-gib", type=float, default=140.4, help="the H200's memory as the run's budget")
    p.add_argument("--start", type=int, default=8)
    p.add_argument("--upper", type=int, default=1024)
    p.add_argument("--rel-tol", type=float, default=0.03)
    a = p.parse_args(argv)
    probes = pd.read_csv(a.probes)
    searches = Path(a.probes).with_name(Path(a.probes).name.replace("_probes", ""))
    if searches.is_file():  # only searches that ran to the end have a known limit
        done = pd.read_csv(searches)
        done = set(map(tuple, done[done["status"] == "ok"][["model", "backend"]].values))
        probes = probes[[(m, b) in done for m, b in zip(probes["model"], probes["backend"])]]
    df = replay(probes, a.budget_gib, a.start, a.upper, a.rel_tol)
    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print(df.to_string(index=False))
    print(f"total probes: H200 run {df['h200_probes'].sum()}, current search {df['replay_probes'].sum()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
