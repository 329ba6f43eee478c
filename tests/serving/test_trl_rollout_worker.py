"""TRL's own AsyncRolloutWorker (a spawned child, as in training) generating through the router and two replicas.

The trainer itself cannot run here (its packed attention needs a GPU flash-attention kernel), but its rollout side
can: the worker sends `trl-policy-v{N}` completions through the router, and the test plays the trainer's sync
(pause, load the next adapter, resume, bump the version, unload the stale one) with TRL's VLLMClient.
"""

from __future__ import annotations

import queue
import time

import pytest
import requests
from trl.experimental.async_grpo.vllm_client import VLLMClient

from grpo_lab.serving.local_cluster import LocalCluster

from .conftest import TOKEN_ENV, metric
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
def test_trl_rollout_worker_through_the_router(token, adapters, monkeypatch):
    from accelerate import PartialState
    from datasets import Dataset
    from trl.experimental.async_grpo import async_rollout_worker
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    # The worker refuses to start without vllm installed, but only checks for it: it talks HTTP and never imports it.
    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda *a, **k: True)
    PartialState()
    cluster = LocalCluster(2, env={"VLLM_API_KEY": token},
                           router=dict(api_key_env=TOKEN_ENV, health_interval_s=0.3, control_timeout_s=30,
                                       upstream_timeout_s=60)).start(timeout=120)
    router, replicas = cluster.router, cluster.replicas
    worker = None
    try:
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i}? Think."}]
                                                for i in range(12)]})
        worker = AsyncRolloutWorker(
            model_name="tiny-qwen3", lora_name="trl-policy", dataset=dataset, reward_funcs=[length_reward],
            processing_class=char_tokenizer(), eos_token_ids=[2], vllm_server_url=router.url, num_generations=4,
            max_inflight_tasks=8, max_tokens=6, request_timeout=60, child_ready_timeout=120)
        worker.start()
        first = take(worker, 8, timeout=120)  # version 0: the base model, served as "trl-policy-v0"
        assert {s.model_version for s in first} == {0}
        client = VLLMClient(router.url)
        client.pause()
        client.load_lora_adapter("trl-policy-v1", adapters["trl-policy-v1"])
        client.resume()
        worker.update_model_version(1)
        later = take(worker, 24, timeout=120)
        assert 1 in {s.model_version for s in later}
        client.unload_lora_adapter("trl-policy-v0")  # a base alias: not an adapter, nothing to unload
        state = requests.get(router.url + "/router/state", timeout=10).json()
        assert state["live_adapters"] == ["trl-policy-v1"]
        routing = state["routing"]
        assert routing["affinity"] >= routing["unmatched"] * 2  # groups of 4 stay together
        assert sum(metric(r.url, "grpo_replica_unknown_model_total") for r in replicas) == 0
        assert sum(metric(r.url, "vllm:prefix_cache_hits_total") for r in replicas) > 0
    finally:
        if worker is not None:
            worker.stop()
        cluster.stop()
