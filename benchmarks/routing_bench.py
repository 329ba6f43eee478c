"""Routing benchmark: replay a GRPO trace through the router's policy, then load-test the HTTP router.

Part 1 replays seed 2's trace shape (1,460 prompts, G=8, 64,728 rollouts, 2 replicas, 128 in flight) through
`PrefixAffinityPolicy` and a round-robin baseline against simulated replicas (`grpo_lab.serving.routing_sim`) and
reports affinity / unmatched / spilled and prefill tokens. Part 2 times the policy's decisions with 512 in flight.
Part 3 runs the real router as a subprocess in front of fake replicas (`fake_replica`, fixed service time), drives
it with 512 concurrent TRL-shaped completions, and reads the router's own per-request overhead (time in the
handler, upstream excluded) from `/router/state`. Figures are printed and written as a long-format CSV.

    python benchmarks/routing_bench.py [--groups 8091] [--out results/routing/routing_bench.csv] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time

import aiohttp

from grpo_lab.serving.routing_policy import AFFINITY, SPILLED, UNMATCHED, RoutingConfig
from grpo_lab.serving.routing_sim import SimConfig, replay
from grpo_lab.serving.trace import TraceConfig, generate_trace


def environment() -> dict:
    import torch
    import trl

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"machine": f"{platform.node()} ({os.cpu_count()} cores)", "cpu": cpu,
            "python": platform.python_version(), "torch": torch.__version__, "trl": trl.__version__,
            "aiohttp": aiohttp.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "load_avg_1m": f"{os.getloadavg()[0]:.2f}"}  # other work on the machine skews the timings


def replay_figures(groups: int, rows: list, replicas: int = 2, in_flight: int = 128, sync_steps: int = 1,
                   arrivals: str = "group", targets: bool = True) -> None:
    trace = generate_trace(TraceConfig(num_groups=groups))
    sim = SimConfig(num_replicas=replicas, max_in_flight=in_flight, completions_per_sync=128 * sync_steps,
                    arrivals=arrivals)
    prefix = replay(trace, sim, "prefix")
    rr = replay(trace, sim, "round_robin")
    figure = f"replay_{replicas}x{in_flight}_{arrivals}_sync{sync_steps}"
    add = lambda metric, value, target="": rows.append((figure, metric, value, target if targets else ""))
    add("rollouts", prefix.requests)
    add("affinity_pct", 100 * prefix.share(AFFINITY), ">= 84.5")
    add("unmatched_pct", 100 * prefix.share(UNMATCHED), "<= 13.0 (floor 12.5)")
    add("unmatched_floor_pct", 100 * prefix.unmatched_floor, "first request of each (adapter, prompt)")
    add("spilled_pct", 100 * prefix.share(SPILLED), "<= 2")
    add("per_replica_split", "/".join(map(str, prefix.per_replica)))
    for name, r in (("prefix", prefix), ("round_robin", rr)):
        add(f"{name}_prompt_tokens", r.prompt_tokens)
        add(f"{name}_cache_hit_tokens", r.cached_tokens)
        add(f"{name}_prefill_tokens", r.prefill_tokens)
        add(f"{name}_cacheable_prefill_tokens", r.cacheable_prefill_tokens)
    add("cacheable_prefill_reduction_x", rr.cacheable_prefill_tokens / prefix.cacheable_prefill_tokens,
        ">= 1.8 (full-block prefill round-robin recomputes / router recomputes)")
    add("prefill_reduction_x", rr.prefill_tokens / prefix.prefill_tokens, "all prompt tokens, tails included")
    add("cache_hit_tokens_x", prefix.cached_tokens / rr.cached_tokens, "tokens served from cache, router / rr")
    add("sim_makespan_ratio_rr_over_prefix", rr.makespan_s / prefix.makespan_s)


def decision_figures(groups: int, rows: list) -> None:
    trace = generate_trace(TraceConfig(num_groups=groups, seed=7))
    result = replay(trace, SimConfig(num_replicas=2, max_in_flight=512), "prefix", RoutingConfig())
    add = lambda metric, value, target="": rows.append(("policy_512_in_flight", metric, value, target))
    add("max_in_flight", result.max_in_flight_seen)
    add("decision_p50_ms", 1e3 * result.latency_percentile(0.5))
    add("decision_p99_ms", 1e3 * result.latency_percentile(0.99), "< 2 (hash + route + claim)")
    add("decisions_per_s_one_core", result.decisions_per_s, ">= 5000")


async def _drive(url: str, trace, in_flight: int, duration_s: float, warmup_s: float) -> list[float]:
    """Keep `in_flight` TRL-shaped completions outstanding; for requests started after the warm-up, the latency
    the client saw minus the fake replica's own service time (so: router + client + loopback)."""
    latencies: list[float] = []
    t_start = time.monotonic()
    stop = t_start + warmup_s + duration_s
    counter = iter(range(10**9))

    async def worker(session):
        while time.monotonic() < stop:
            i = next(counter)
            group = trace[(i // 8) % len(trace)]
            payload = {"model": "fake", "prompt": group.prompt_ids, "max_tokens": 3000, "temperature": 1.0,
                       "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True,
                       "logprobs": 0, "seed": i}
            began = time.monotonic()
            t0 = time.perf_counter()
            async with session.post(url + "/v1/completions", json=payload) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"router answered {resp.status}")
            if began >= t_start + warmup_s:
                latencies.append(time.perf_counter() - t0 - json.loads(body)["service_s"])

    async def reset_after_warmup(session):
        await asyncio.sleep(warmup_s)
        async with session.get(url + "/router/state", params={"reset_overhead": "1"}) as resp:
            await resp.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(reset_after_warmup(session), *(worker(session) for _ in range(in_flight)))
    return latencies


def _start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    return proc, line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proxy_figures(in_flight: int, duration_s: float, delay_s: float, rows: list, figure: str | None = None) -> None:
    fake, line = _start([sys.executable, "-m", "grpo_lab.serving.fake_replica", "--ports", "0", "0",
                         "--delay-s", str(delay_s)])
    ports = line.split()[1:]
    router_port = _free_port()
    router = subprocess.Popen([sys.executable, "-m", "grpo_lab.serving.router", "--port", str(router_port),
                               "--log-level", "WARNING", *sum((["--replica", f"http://127.0.0.1:{p}"] for p in ports),
                                                              [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{router_port}"
    try:
        import requests

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        trace = generate_trace(TraceConfig(num_groups=2000, seed=11))
        latencies = asyncio.run(_drive(url, trace, in_flight, duration_s, warmup_s=max(2 * delay_s, 1.0)))
        state = requests.get(url + "/router/state", timeout=10).json()
    finally:
        router.terminate()
        fake.terminate()
        router.wait(10)
        fake.wait(10)
    lat = sorted(latencies)
    pick = lambda q: lat[min(int(q * len(lat)), len(lat) - 1)]
    main = figure is None
    figure = figure or f"http_router_{in_flight}_in_flight"
    add = lambda metric, value, target="": rows.append((figure, metric, value, target if main else ""))
    add("requests", len(lat))
    add("throughput_req_per_s", len(lat) / duration_s)
    add("router_overhead_p50_ms", state["overhead_ms"]["p50"])
    add("router_overhead_p99_ms", state["overhead_ms"]["p99"], "< 2 (router-side time per request)")
    add("end_to_end_added_p50_ms", 1e3 * pick(0.5), "client latency - upstream service time")
    add("end_to_end_added_p99_ms", 1e3 * pick(0.99), "includes the client and loopback, all on the 2 shared cores")
    add("routing_counts", json.dumps(state["routing"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=8091, help="groups replayed (8091 x 8 = seed 2's 64,728 rollouts)")
    p.add_argument("--out", default="results/routing/routing_bench.csv")
    p.add_argument("--in-flight", type=int, default=512)
    p.add_argument("--duration-s", type=float, default=30.0, help="measured HTTP load, after a warm-up")
    p.add_argument("--delay-s", type=float, default=5.0,
                   help="fake service time; GRPO rollouts of thousands of tokens take seconds")
    p.add_argument("--quick", action="store_true", help="small trace and a short HTTP run")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.duration_s, args.delay_s = 500, 6.0, 2.0
    rows: list = []
    t0 = time.time()
    replay_figures(args.groups, rows, sync_steps=2)  # the targets' shape: G at a time, version every few steps
    replay_figures(args.groups, rows, sync_steps=1, targets=False)
    replay_figures(args.groups, rows, sync_steps=1, arrivals="rollout", targets=False)  # TRL 1.16's worker, exactly
    replay_figures(args.groups, rows, sync_steps=4, arrivals="rollout", targets=False)
    replay_figures(args.groups, rows, replicas=4, in_flight=384, arrivals="rollout", targets=False)  # 4 GPUs
    decision_figures(args.groups, rows)
    proxy_figures(args.in_flight, args.duration_s, args.delay_s, rows)
    # instant fakes: the HTTP stack's ceiling on this machine (client, router and fakes share the cores)
    proxy_figures(64, 8.0, 0.0, rows, figure="http_router_saturation")
    env = environment()
    width = max(len(r[1]) for r in rows)
    for figure, metric, value, target in rows:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{figure:28s} {metric:{width}s} {shown:>14s}  {target}")
    print(f"({time.time() - t0:.0f} s on {env['machine']}, {env['cpu']}, load average {env['load_avg_1m']})")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["figure", "metric", "value", "target", *env])
        for row in rows:
            w.writerow([*row, *env.values()])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
