"""TRL's own AsyncRolloutWorker (a spawned child, as in training) generating through the router and two replicas.

The trainer itself cannot run here (its packed attention needs a GPU flash-attention kernel), but its rollout side
can: the worker sends `trl-policy-v{N}` completions through the router, and the test plays the trainer's sync
(pause, load the next adapter, resume, bump the version) with TRL's VLLMClient.
"""

from __future__ import annotations

import queue
import time

import pytest
import requests
from trl.experimental.async_grpo.vllm_client import VLLMClient

from .conftest import metric
from .trl_helpers import char_tokenizer, length_reward


def take(worker, n: int, timeout: float) -> list:
    samples, deadline = [], time.monotonic() + timeout
    while len(samples) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"only {len(samples)} of {n} rollout samples within {timeout}s")
        try:
            samples.append(worker.rollout_buffer.get(timeout=min(left, 1.0)))
        except queue.Empty:
            worker.check_health(stale_after_s=120)
    return samples


@pytest.mark.slow
def test_trl_rollout_worker_through_the_router(cluster, adapters, monkeypatch):
    from datasets import Dataset
    from trl.experimental.async_grpo import async_rollout_worker
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    # The worker refuses to start without vllm installed, but only checks for it: it talks HTTP and never imports it.
    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda *a, **k: True)
    routing_before = requests.get(cluster.url + "/router/state", timeout=10).json()["routing"]
    hits_before = sum(metric(r.url, "vllm:prefix_cache_hits_total") for r in cluster.replicas)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i}? Think."}]
                                            for i in range(12)]})
    worker = AsyncRolloutWorker(
        model_name="tiny-qwen3", lora_name="trl-policy", dataset=dataset, reward_funcs=[length_reward],
        processing_class=char_tokenizer(), eos_token_ids=[2], vllm_server_url=cluster.url, num_generations=4,
        max_inflight_tasks=8, max_tokens=6, request_timeout=60, child_ready_timeout=120)
    worker.start()
    try:
        first = take(worker, 8, timeout=120)  # version 0: the base model, served as "trl-policy-v0"
        assert {s.model_version for s in first} == {0}
        client = VLLMClient(cluster.url)
        client.pause()
        client.load_lora_adapter("trl-policy-v3", adapters["trl-policy-v3"])
        client.resume()
        worker.update_model_version(3)
        later = take(worker, 24, timeout=120)
        assert 3 in {s.model_version for s in later}
    finally:
        worker.stop()
    state = requests.get(cluster.url + "/router/state", timeout=10).json()
    assert "trl-policy-v3" in state["live_adapters"]
    delta = {k: state["routing"][k] - routing_before[k] for k in routing_before}
    assert delta["affinity"] >= 2 * delta["unmatched"] > 0  # groups of 4 stay together
    assert sum(metric(r.url, "grpo_replica_unknown_model_total") for r in cluster.replicas) == 0
    assert sum(metric(r.url, "vllm:prefix_cache_hits_total") for r in cluster.replicas) > hits_before
    VLLMClient(cluster.url).unload_lora_adapter("trl-policy-v3")


def test_a_replica_server_error_points_to_its_log_and_a_dead_server_to_the_router():
    import aiohttp

    from grpo_lab.async_loop.rollout_worker import _failure_hint, _RetryableStatus

    assert "<output-dir>/logs/" in _failure_hint(_RetryableStatus(500, "Server got itself in trouble"))
    assert "Is the router" in _failure_hint(_RetryableStatus(503, "no replica in service"))  # the router's own 503
    assert "Is the router" in _failure_hint(aiohttp.ClientConnectionError("refused"))
    assert "Is the router" in _failure_hint(_RetryableStatus(404, "not loaded yet"))
