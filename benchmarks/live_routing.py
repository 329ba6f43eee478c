"""The router's routing on the live loop: group-consistent versions (the loop's default) vs TRL's per-rollout ones.

Runs the embedded async loop (2 CPU replicas behind the router) twice with the same seed and settings, once with
`group_consistent_versions=True` and once with TRL's behaviour, and reads what the router decided (affinity,
unmatched, spilled) and what the replicas' prefix caches report (`vllm:prefix_cache_queries_total` /
`vllm:prefix_cache_hits_total`, in tokens). Writes `results/routing/live_loop_routing.csv` with machine and versions.

    python benchmarks/live_routing.py --steps 15 --out results/routing
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd
import requests


def replica_cache(urls: list[str]) -> tuple[float, float]:
    from grpo_lab.serving.wire.metrics import parse_text

    queries = hits = 0.0
    for url in urls:
        values = parse_text(requests.get(url + "/metrics", timeout=10).text)
        for key, value in values.items():
            name = key.split("{")[0]
            queries += value if name == "vllm:prefix_cache_queries_total" else 0.0
            hits += value if name == "vllm:prefix_cache_hits_total" else 0.0
    return queries, hits


def one_run(group_versions: bool, steps: int, seed: int) -> dict:
    from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args

    out = tempfile.mkdtemp(prefix="grpo-lab-live-routing-")
    args = embedded_trainer_args(out, max_steps=steps, save_strategy="no", seed=seed,
                                 group_consistent_versions=group_versions)
    t0 = time.perf_counter()
    with AsyncLoop(LoopConfig(replicas=2), args, progress=False) as loop:
        loop.train()
        state = requests.get(loop.url + "/router/state", timeout=10).json()
        queries, hits = replica_cache([r.url for r in loop.cluster.replicas])
    routing = state["routing"]
    total = sum(routing.values())
    return {"group_consistent_versions": group_versions, "steps": steps, "rollouts": total,
            "affinity": routing.get("affinity", 0) / total, "unmatched": routing.get("unmatched", 0) / total,
            "spilled": routing.get("spilled", 0) / total, "prefix_cache_hit_rate": hits / max(queries, 1.0),
            "prompt_tokens": queries, "cached_tokens": hits, "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from grpo_lab.lab.records import run_record

    rows = [one_run(g, a.steps, a.seed) for g in (True, False)]
    frame = pd.DataFrame(rows)
    for key, value in run_record("cpu").items():
        frame[key] = value
    print(frame[["group_consistent_versions", "rollouts", "affinity", "unmatched", "spilled",
                 "prefix_cache_hit_rate", "wall_s"]].to_string(index=False))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        frame.to_csv(Path(a.out) / "live_loop_routing.csv", index=False)
        print("wrote", Path(a.out) / "live_loop_routing.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
