"""The CPU replica, like vLLM, generates nothing for a client that has left, and tells a misroute from an unload.

A completion that waited behind others (a paused replica, a hung one resumed, a survivor queueing re-sent work)
may find its client gone (the router cut it, the trainer died): it must stop before prefill instead of holding the
replica for nobody. One whose adapter is unloaded while it waits or runs was routed right (the replica held the
adapter when it came), so it is counted apart from one sent for an adapter the replica never held: the first is an
unload cutting work, the second a misroute.
"""

from __future__ import annotations

import threading

import pytest
import requests

from grpo_lab.serving.replicas.processes import CPUReplicaProcess

from .conftest import REPLICA_ARGS, metric, metrics_of, send_then_hang_up, trl_payload, wait_for

PROMPT = list(range(200, 240))


@pytest.fixture(scope="module")
def replica(token):
    process = CPUReplicaProcess(["--port", "0", *REPLICA_ARGS], {"VLLM_API_KEY": token}).wait_ready()
    try:
        yield process
    finally:
        process.stop()


def in_progress(replica) -> float:
    return metric(replica.url, "grpo_replica_completions_in_progress")


def _post(replica, token, path, body, answers: list | None = None):
    reply = requests.post(replica.url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    if answers is not None:
        answers.append(reply)
    return reply


def test_waiting_completions_stop_when_their_client_left_or_their_adapter_went(replica, token, adapters):
    assert _post(replica, token, "/v1/load_lora_adapter",
                 {"lora_name": "gone-soon", "lora_path": adapters["trl-policy-v1"]}).status_code == 200
    before = {name: metric(replica.url, name) for name in (
        "grpo_replica_unknown_model_total", "grpo_replica_unloaded_under_completion_total",
        "grpo_replica_abandoned_total", "vllm:request_success_total")}
    assert _post(replica, token, "/pause?mode=keep", {}).status_code == 200
    answers: list = []
    first = threading.Thread(target=_post, args=(replica, token, "/v1/completions",
                                                 trl_payload("tiny-qwen3", PROMPT, seed=1), answers))
    queued = threading.Thread(target=_post, args=(replica, token, "/v1/completions",
                                                  trl_payload("gone-soon", PROMPT, seed=2), answers))
    try:
        first.start()  # holds the generation thread, waiting for the resume before its prefill
        port = int(replica.url.rsplit(":", 1)[1])
        wait_for(lambda: in_progress(replica) == 1, 30, "the first completion accepted")
        send_then_hang_up(port, "/v1/completions", trl_payload("tiny-qwen3", PROMPT, seed=3),
                          {"Authorization": f"Bearer {token}"},  # queued behind it, then its client dies
                          before_hang_up=lambda: wait_for(lambda: in_progress(replica) == 2, 30, "queued"))
        queued.start()
        wait_for(lambda: in_progress(replica) == 3, 30, "the adapter's completion queued")
        assert _post(replica, token, "/v1/unload_lora_adapter", {"lora_name": "gone-soon"}).status_code == 200
    finally:
        _post(replica, token, "/resume", {})
    first.join(60), queued.join(60)
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200, 404], [r.text[:200] for r in answers]
    after = {name: metric(replica.url, name) for name in before}
    assert after["grpo_replica_abandoned_total"] - before["grpo_replica_abandoned_total"] == 1
    assert after["grpo_replica_unloaded_under_completion_total"] - \
        before["grpo_replica_unloaded_under_completion_total"] == 1
    assert after["grpo_replica_unknown_model_total"] == before["grpo_replica_unknown_model_total"]  # no misroute
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1  # only the first ran
    # a completion sent for an adapter the replica does not hold is the misroute it counts
    assert _post(replica, token, "/v1/completions", trl_payload("gone-soon", PROMPT, seed=4)).status_code == 404
    assert metric(replica.url, "grpo_replica_unknown_model_total") == after["grpo_replica_unknown_model_total"] + 1


def test_replica_reports_time_spent_per_kind_of_work(replica, token, adapters):
    """A shared pool's cost shows as replica time spent on adapters: loads, unloads and completions are each counted
    and timed (`grpo_replica_work_*{work=...}`), so a benchmark can tell generation from adapter churn."""
    def work(kind: str) -> tuple[float, float]:
        values = metrics_of(replica.url)
        key = f'{{work="{kind}"}}'
        return values.get("grpo_replica_work_total" + key, 0.0), values.get("grpo_replica_work_seconds_total" + key, 0.0)

    before = {kind: work(kind) for kind in ("adapter_load", "adapter_unload", "generate")}
    assert _post(replica, token, "/v1/load_lora_adapter",
                 {"lora_name": "timed", "lora_path": adapters["trl-policy-v1"]}).status_code == 200
    for seed in (5, 6):
        assert _post(replica, token, "/v1/completions", trl_payload("timed", PROMPT, seed=seed)).status_code == 200
    assert _post(replica, token, "/v1/unload_lora_adapter", {"lora_name": "timed"}).status_code == 200
    for kind, times in (("adapter_load", 1), ("generate", 2), ("adapter_unload", 1)):
        count, seconds = work(kind)
        assert count - before[kind][0] == times, kind
        assert seconds > before[kind][1], kind
