"""The router's routing decisions predict the prefix-cache hits that vLLM itself reports on /metrics.

GRPO groups (G rollouts of one prompt, different seeds) go through the router. Every prompt is 97 tokens: a
32-token "chat template" block shared by all prompts, then 65 prompt-specific tokens. vLLM caches full 32-token
blocks and always recomputes the last prompt token, so a request can hit at most 96 tokens (3 blocks). From the
router's own per-replica counts of how it routed (`grpo_router_routed_total{replica,decision}`):

- affinity (the replica already holds the prompt): 96 tokens hit;
- unmatched or spilled (a new prompt for that replica): 32 tokens, the template block, except for the very first
  request a replica sees (0).

vLLM's counters must agree with that prediction to within one block per group, and affinity must be what makes
the hit rate high (round-robin would leave a group's rollouts on both replicas).
"""

from __future__ import annotations

import random

import requests

from grpo_lab.serving.wire.metrics import parse_text

from .conftest import SERVED_NAME, run_concurrently, trl_payload

BLOCK, G, GROUPS, WAVE = 32, 4, 12, 2  # WAVE groups in flight at once
PROMPT_LEN = 97


def per_replica(url: str, name: str, label: str = "") -> dict[str, float]:
    values = {}
    for key, value in parse_text(requests.get(url + "/metrics", timeout=30).text).items():
        if key.split("{")[0] == name and label in key:
            values[key] = values.get(key, 0.0) + value
    return values


def vllm_counter(replica, name: str) -> float:
    return sum(per_replica(replica.url, name).values())


def routed(router_url: str, replica_url: str) -> dict[str, float]:
    counts = {"affinity": 0.0, "unmatched": 0.0, "spilled": 0.0}
    for key, value in per_replica(router_url, "grpo_router_routed_total", f'replica="{replica_url}"').items():
        for decision in counts:
            if f'decision="{decision}"' in key:
                counts[decision] += value
    return counts


def test_router_affinity_predicts_vllm_prefix_cache_hits(cluster):
    rng = random.Random(1234)
    template = [rng.randrange(5, 45) for _ in range(BLOCK)]  # new to both replicas' caches
    prompts = [template + [rng.randrange(5, 45) for _ in range(PROMPT_LEN - BLOCK)] for _ in range(GROUPS)]
    before = {r.url: (vllm_counter(r, "vllm:prefix_cache_hits_total"),
                      vllm_counter(r, "vllm:prefix_cache_queries_total"), routed(cluster.url, r.url))
              for r in cluster.replicas}

    for start in range(0, GROUPS, WAVE):
        payloads = [trl_payload(SERVED_NAME, prompts[g], seed=1000 * g + k, max_tokens=4)
                    for g in range(start, start + WAVE) for k in range(G)]
        for answer in run_concurrently(cluster.url, payloads):
            assert answer["choices"][0]["token_ids"], answer

    report = []
    total_predicted = total_hits = 0.0
    for r in cluster.replicas:
        hits0, queries0, routed0 = before[r.url]
        hits = vllm_counter(r, "vllm:prefix_cache_hits_total") - hits0
        queries = vllm_counter(r, "vllm:prefix_cache_queries_total") - queries0
        counts = {k: v - routed0[k] for k, v in routed(cluster.url, r.url).items()}
        served = sum(counts.values())
        new_prompts = counts["unmatched"] + counts["spilled"]
        predicted = 96 * counts["affinity"] + BLOCK * new_prompts - (BLOCK if served else 0)
        report.append(dict(replica=r.url, routed=counts, hits=hits, predicted=predicted, queries=queries))
        assert queries == PROMPT_LEN * served, report  # vLLM looked up every prompt token of what it was sent
        total_predicted += predicted
        total_hits += hits
    print(report)  # pytest -rP shows it
    # stated tolerance: one block per group, over both replicas
    assert abs(total_hits - total_predicted) <= BLOCK * GROUPS * 0.25, report
    for row in report:
        assert abs(row["hits"] - row["predicted"]) <= BLOCK * GROUPS * 0.25, report
    sent = GROUPS * G
    assert sum(sum(row["routed"].values()) for row in report) == sent, report
    # affinity is what makes the cache work: G-1 of every G rollouts find their prompt
    assert sum(row["routed"]["affinity"] for row in report) >= 0.7 * sent, report
    assert total_hits >= 0.7 * 96 * sent * (G - 1) / G, report
