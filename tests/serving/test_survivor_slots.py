"""A survivor's adapter slots after a replica dies (issue 43, defect 3).

When a replica dies its completions are re-sent to the survivors, where they queue behind the survivors' own; a
drain of an unloaded version waits for them, so on a survivor drains outlast a weight sync, and TRL loads the next
version while the replicas are paused, when no drain can progress. The survivor then held the live versions, two
draining ones and had no slot for the new one: `400 cannot hold more than max_loras=7 adapters`, and the run ended
(seen with `--launcher ray`, where the restart's CPU load slowed the survivor further). The router now ends the
longest drain on a replica that refused the load for lack of slots, and loads again (a replica that takes the
extra adapter, as vLLM does by evicting from its cache, keeps its drains); what that drain waited for is more than
`max_staleness` versions behind the one being loaded, so it would be dropped as too stale anyway."""

from __future__ import annotations

import threading

import requests

from grpo_lab.serving.adapters.slots import max_loras_for
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router

from .conftest import TOKEN_ENV, metric, wait_for
from .fake_vllm import FakeCluster, FakeVLLM

STALENESS = 4
SLOTS = max_loras_for(STALENESS)  # 7


def sync(url: str, version: int) -> requests.Response:
    """What TRL's trainer sends at each weight sync: pause, load vN, resume, unload v(N-S-1)."""
    assert requests.post(url + "/pause", params={"mode": "keep"}, timeout=10).status_code == 200
    try:
        loaded = requests.post(url + "/v1/load_lora_adapter",
                               json={"lora_name": f"v{version}", "lora_path": f"/p/v{version}"}, timeout=30)
    finally:
        assert requests.post(url + "/resume", timeout=10).status_code == 200
    if version - STALENESS - 1 >= 1:
        requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": f"v{version - STALENESS - 1}"}, timeout=10)
    return loaded


def test_a_survivor_queueing_a_dead_replicas_completions_is_never_overfilled(token):
    survivor, victim = FakeVLLM(max_loras=SLOTS), FakeVLLM(max_loras=SLOTS)
    with FakeCluster(survivor, victim):
        router = start_router(RouterConfig(replicas=[survivor.url, victim.url], port=0, api_key_env=TOKEN_ENV,
                                           health_interval_s=0.05, health_timeout_s=2, load_retry_deadline_s=1,
                                           control_timeout_s=10, upstream_timeout_s=30))
        try:
            router.wait_ready(timeout=10)
            url = router.url
            for version in range(1, STALENESS + 2):  # v1..v5 live
                assert sync(url, version).status_code == 200
            # completions of the two oldest versions, slow to answer (a long queue on the survivor)
            survivor.completion_delay_s = victim.completion_delay_s = 6.0
            answers: list = []
            senders = [threading.Thread(target=lambda m=m: answers.append(requests.post(
                url + "/v1/completions", json={"model": m, "prompt": [1, 2, 3, int(m[-1])]}, timeout=60).status_code))
                for m in ("v1", "v1", "v2", "v2")]
            for s in senders:
                s.start()
            wait_for(lambda: survivor.calls.get("/v1/completions", 0) + victim.calls.get("/v1/completions", 0) >= 4,
                     10, "the completions sent")
            victim.malformed = True  # it dies: out of routing, its completions re-sent to the survivor
            wait_for(lambda: survivor.calls.get("/v1/completions", 0) >= 4, 10, "the re-sends on the survivor")
            for version in range(STALENESS + 2, STALENESS + 5):  # v6, v7, v8: v1 and v2 drain on the survivor
                reply = sync(url, version)
                assert reply.status_code == 200, reply.text
            assert survivor.most_adapters <= SLOTS
            assert set(survivor.adapters) >= {f"v{v}" for v in range(4, 9)}  # the live window, v8 included
            assert metric(url, "grpo_router_drains_cut_total") >= 1
            for s in senders:
                s.join(60)
            assert len(answers) == 4  # each answered (the cut ones with 404: their version is gone)
        finally:
            router.stop()
