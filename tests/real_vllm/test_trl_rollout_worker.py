"""TRL's own AsyncRolloutWorker (a spawned child, as in training) generating through the router from two real vLLM
replicas, while the test plays the trainer's side of three weight syncs with TRL's VLLMClient (pause, load the
next adapter, resume, bump the version, unload the one that fell out of the staleness window)."""

from __future__ import annotations

import requests
from serving.test_trl_rollout_worker import take
from trl.experimental.async_grpo.vllm_client import VLLMClient

from .conftest import SERVED_NAME, served_models, unload, wait_until_unloaded

STALENESS = 1  # unload v(N-2) at sync N, so the test sees unloads too


def test_trl_rollout_worker_through_the_router(cluster, adapters, model_dir, token, monkeypatch):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import async_rollout_worker
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from grpo_lab.tasks.rewards import math_reward

    # The worker refuses to start without vllm importable in the trainer's env, which only speaks HTTP to it.
    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda *a, **k: True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [(10 + 7 * i % 90, 11 + 13 * i % 89) for i in range(16)]
    dataset = Dataset.from_dict({
        # long enough (two 32-token KV blocks) for prefix affinity to matter
        "prompt": [[{"role": "user", "content": f"please add the two numbers and box the sum: {a}+{b}="}]
                   for a, b in problems],
        "answer": [str(a + b) for a, b in problems]})
    routing_before = requests.get(cluster.url + "/router/state", timeout=10).json()["routing"]
    worker = AsyncRolloutWorker(
        model_name=SERVED_NAME, lora_name="trl-policy", dataset=dataset, reward_funcs=[math_reward],
        processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], vllm_server_url=cluster.url,
        num_generations=4, max_inflight_tasks=8, max_tokens=8, request_timeout=120, child_ready_timeout=180)
    worker.start()
    client = VLLMClient(cluster.url)
    versions_seen = set()
    try:
        versions_seen |= {s.model_version for s in take(worker, 8, timeout=180)}  # v0: the base model
        for version in (1, 2, 3):
            client.pause()
            client.load_lora_adapter(f"trl-policy-v{version}", adapters[f"trl-policy-v{version}"])
            client.resume()
            worker.update_model_version(version)
            if version - STALENESS - 1 >= 1:
                client.unload_lora_adapter(f"trl-policy-v{version - STALENESS - 1}")
            versions_seen |= {s.model_version for s in take(worker, 8, timeout=180)}
        for _ in range(30):  # samples already in flight at the last sync come first
            if 3 in versions_seen:
                break
            versions_seen |= {s.model_version for s in take(worker, 4, timeout=180)}
    finally:
        worker.stop()
    assert {0, 3} <= versions_seen and versions_seen <= {0, 1, 2, 3}
    wait_until_unloaded(cluster.replicas, token, "trl-policy-v1")
    for replica in cluster.replicas:  # what vLLM itself holds at the end: the window {v2, v3}
        assert served_models(replica, token) == {SERVED_NAME, "trl-policy-v0", "trl-policy-v2", "trl-policy-v3"}
    state = requests.get(cluster.url + "/router/state", timeout=10).json()
    delta = {k: state["routing"][k] - routing_before[k] for k in routing_before}
    assert delta["affinity"] >= 2 * delta["unmatched"] > 0, delta  # groups of 4 stay together
    for name in ("trl-policy-v2", "trl-policy-v3"):
        unload(cluster, token, name)
