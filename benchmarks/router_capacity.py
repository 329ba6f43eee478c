"""How many replicas one router serves: its measured decision rate against the completion rate of 8, 64 and 256
vLLM replicas at the recipe's lengths.

Part 1 drives the router's own decision path as fast as one core allows, with no HTTP: a `ReplicaPool` of N replicas
in service (8, 64, 256), each holding the policy's adapter, and for each completion exactly what
`forwarding.Forwarder.forward` does before and after its upstream call: the candidates holding the adapter, the
prompt's block hashes, `PrefixAffinityPolicy.route`, and `finish` once the completion is "answered" (128 in flight,
released in order). The trace is the recipe's shape (`trace.generate_trace`: the Sanity prompts' lengths, 23 shared
template tokens, G = 8 rollouts issued together, a new adapter version every 128 completions = one sync per step).

Part 2 measures the whole HTTP path on loopback: the router as a subprocess in front of N instant fake replicas
(`fake_replica`), a client keeping 64 completions in flight; the router's own time per completion (from
`/router/state`), the latency it adds end to end, and the requests/s ceiling. Client, router and fakes share the
machine's cores, so this ceiling is a floor of what a router on its own core does.

Part 3 is arithmetic: completions/s that R replicas produce = R x (generated tokens/s per replica) / (tokens per
completion), for the recipe's 1,000-3,000-token completions and a per-replica rate of 10,000-40,000 generated tokens/s
(see docs/clusters.md for why), against the rates above.

    python benchmarks/router_capacity.py [--quick]

Writes results/routing/router_capacity.csv with machine, versions and date (`lab.records.run_record`).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import os
import subprocess
import sys
import time

import aiohttp

from grpo_lab.lab.records import run_record
from grpo_lab.serving.routing.forwarding import Forwarder
from grpo_lab.serving.wire.metrics import Registry
from grpo_lab.serving.router.replica_pool import ReplicaPool
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.sim.trace import TraceConfig, generate_trace
from grpo_lab.serving.wire.upstream import IN_SERVICE
from routing_bench import drive_completions, free_port  # benchmarks/ is on sys.path when run as a script

REPLICAS = (8, 64, 256)
IN_FLIGHT = 128  # TRL's default max_inflight_tasks
COMPLETIONS_PER_STEP = 128  # the recipe: a sync (a new adapter name) every 128 completions
TOKENS_PER_COMPLETION = (1000, 3000)
REPLICA_TOKENS_PER_S = (10_000, 40_000)  # generated tokens/s per vLLM replica (docs/clusters.md says why)


def decision_path(replicas: int, groups: int) -> dict:
    """Decisions per second of the router's routing path with `replicas` replicas in service (one core)."""
    config = RouterConfig(replicas=[f"http://10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(replicas)])
    pool = ReplicaPool(config, client=None, metrics=Registry())
    for r in pool.replicas:
        r.state, r.base_models = IN_SERVICE, {"base"}
    forwarder = Forwarder(pool, None, None, Registry(), config)
    trace = generate_trace(TraceConfig(num_groups=groups, seed=1))
    policy = pool.policy
    in_flight: list = []
    latencies: list[float] = []
    busy = 0.0
    served = 0

    async def run():
        nonlocal busy, served
        for group in trace:
            version = served // COMPLETIONS_PER_STEP + 1
            adapter = f"trl-policy-v{version}"
            if adapter not in pool.live_adapters:  # a weight sync: every replica holds the new version
                pool.live_adapters[adapter] = f"/adapters/{adapter}"
                for r in pool.replicas:
                    r.adapters[adapter] = pool.live_adapters[adapter]
            for _ in group.completion_tokens:
                t0 = time.perf_counter()
                candidates = [r.index for r in pool.candidates(adapter)]
                hashes = await forwarder.hashes(group.prompt_ids, adapter)
                decision = policy.route(hashes, candidates)
                t1 = time.perf_counter()
                in_flight.append(decision)
                if len(in_flight) > IN_FLIGHT:
                    t2 = time.perf_counter()
                    policy.finish(in_flight.pop(0), ok=True)
                    busy += time.perf_counter() - t2
                latencies.append(t1 - t0)
                busy += t1 - t0
                served += 1

    asyncio.run(run())
    latencies.sort()
    pick = lambda q: latencies[min(int(q * len(latencies)), len(latencies) - 1)] * 1e3
    return {"replicas": replicas, "decisions": served, "decisions_per_s": served / busy,
            "decision_p50_ms": pick(0.5), "decision_p99_ms": pick(0.99), "counts": dict(policy.counts),
            "blocks": policy.num_blocks}


def http_path(replicas: int, in_flight: int, duration_s: float, delay_s: float) -> dict:
    """The router as a subprocess in front of `replicas` fake replicas (one process serving them all)."""
    import requests

    fake = subprocess.Popen([sys.executable, "-m", "grpo_lab.serving.replicas.fake_replica", "--ports", *["0"] * replicas,
                             "--delay-s", str(delay_s), "--jitter", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    ports = fake.stdout.readline().split()[1:]
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "grpo_lab.serving.router.server", "--port", str(port),
                               "--log-level", "WARNING", *sum((["--replica", f"http://127.0.0.1:{p}"] for p in ports),
                                                              [])], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                state = requests.get(url + "/router/state", timeout=2).json()
                if sum(r["state"] == "in_service" for r in state["replicas"]) == replicas:
                    break
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.2)
        prompts = [[7] * 23 + [i] * 72 for i in range(1, 200)]  # 95 tokens: the recipe's median prompt
        added = asyncio.run(drive_completions(url, prompts, in_flight, duration_s, warmup_s=2.0))
        state = requests.get(url + "/router/state", timeout=10).json()
    finally:
        for proc in (router, fake):
            proc.terminate()
            proc.wait(10)
    added.sort()
    pick = lambda q: added[min(int(q * len(added)), len(added) - 1)] * 1e3
    return {"replicas": replicas, "requests": len(added), "requests_per_s": len(added) / duration_s,
            "router_overhead_p50_ms": state["overhead_ms"]["p50"], "router_overhead_p99_ms": state["overhead_ms"]["p99"],
            "added_p50_ms": pick(0.5), "added_p99_ms": pick(0.99)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=2000, help="GRPO groups replayed per replica count (x G=8)")
    p.add_argument("--duration-s", type=float, default=10.0, help="measured HTTP load per run, after a warm-up")
    p.add_argument("--out", default="results/routing/router_capacity.csv")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.duration_s = 300, 3.0
    env = {**run_record("cpu"), "aiohttp": aiohttp.__version__, "load_avg_1m": round(os.getloadavg()[0], 2)}
    rows = []
    decisions = {}
    for n in REPLICAS:
        d = decision_path(n, args.groups)
        decisions[n] = d
        print(f"decision path, {n:3d} replicas: {d['decisions_per_s']:8.0f} decisions/s (one core), p50 "
              f"{d['decision_p50_ms']:.3f} ms, p99 {d['decision_p99_ms']:.3f} ms, {d['counts']}", flush=True)
        for metric in ("decisions_per_s", "decision_p50_ms", "decision_p99_ms"):
            rows.append(("decision_path", n, metric, round(d[metric], 4), "hash + candidates + route + finish, "
                         f"{IN_FLIGHT} in flight, no HTTP, one core"))
    http = {}
    for n, in_flight, delay in ((8, 64, 0.05), (64, 64, 0.05), (8, 64, 0.0)):
        figure = "http_saturation" if delay == 0.0 else "http_path"
        h = http_path(n, in_flight, args.duration_s, delay)
        http[(figure, n)] = h
        print(f"{figure}, {n:3d} fake replicas: {h['requests_per_s']:7.0f} requests/s, router p50/p99 "
              f"{h['router_overhead_p50_ms']:.2f}/{h['router_overhead_p99_ms']:.2f} ms, added end to end p50/p99 "
              f"{h['added_p50_ms']:.2f}/{h['added_p99_ms']:.2f} ms", flush=True)
        for metric in ("requests_per_s", "router_overhead_p50_ms", "router_overhead_p99_ms", "added_p50_ms",
                       "added_p99_ms"):
            rows.append((figure, n, metric, round(h[metric], 4), f"{in_flight} in flight, fake service {delay} s, "
                         "client + router + fakes on the same cores"))
    ceiling = http[("http_saturation", 8)]["requests_per_s"]
    for n in REPLICAS:
        for tokens in TOKENS_PER_COMPLETION:
            for rate in REPLICA_TOKENS_PER_S:
                demand = n * rate / tokens
                routers = max(1, math.ceil(demand / (0.5 * ceiling)))  # at half the measured HTTP ceiling
                rows.append(("capacity", n, f"completions_per_s@{tokens}tok,{rate}tok/s", round(demand, 1),
                             f"decision path {decisions[n]['decisions_per_s']:.0f}/s; HTTP ceiling {ceiling:.0f}/s; "
                             f"routers at half the ceiling: {routers}"))
                print(f"{n:3d} replicas x {rate:6d} tok/s / {tokens} tok = {demand:8.1f} completions/s -> "
                      f"{routers} router(s)", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["figure", "replicas", "metric", "value", "note", *env])
        for row in rows:
            w.writerow([*row, *env.values()])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
