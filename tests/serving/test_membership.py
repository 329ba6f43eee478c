"""Membership that changes while the router runs, on real CPU replica processes: a replica added in the middle of
traffic is routed to only once it holds the live adapters; a replica removed gets nothing more, the others keep their
prefix ownership, and completions running there finish elsewhere."""

from __future__ import annotations

import random
import threading
import time
import types

import pytest
import requests

from grpo_lab.serving.replicas.processes import CPUReplicaProcess
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router

from .conftest import REPLICA_ARGS, TOKEN_ENV, metric, metrics_of, run_group, trl_payload, wait_for

ADMIN_ENV = "GRPO_LAB_TEST_ADMIN_KEY"
LAG_S = 1.5


@pytest.fixture(scope="module")
def elastic(token, monkeypatch_module):
    """Two CPU replicas behind a router with an admin key; a third, slow-mounting one started but not a member."""
    from accelerate import PartialState

    PartialState()
    admin = "adm-" + token[-12:]
    monkeypatch_module.setenv(ADMIN_ENV, admin)
    env = {"VLLM_API_KEY": token}
    a = CPUReplicaProcess(["--port", "0", *REPLICA_ARGS], env)
    c = CPUReplicaProcess(["--port", "0", *REPLICA_ARGS], env)
    b = CPUReplicaProcess(["--port", "0", *REPLICA_ARGS, "--storage-lag-s", str(LAG_S)], env)  # a lagging mount
    a.wait_ready(), b.wait_ready(), c.wait_ready()
    router = start_router(RouterConfig(replicas=[a.url, c.url], port=0, api_key_env=TOKEN_ENV, admin_api_key_env=ADMIN_ENV,
                                       health_interval_s=0.1, health_timeout_s=2, load_retry_deadline_s=15,
                                       control_timeout_s=30, upstream_timeout_s=60))
    try:
        router.wait_ready(2, timeout=60)
        yield types.SimpleNamespace(router=router, url=router.url, a=a, b=b, c=c, admin=admin, token=token)
    finally:
        router.stop()
        for replica in (a, b, c):
            replica.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def state(url: str) -> dict:
    return requests.get(url + "/router/state", timeout=10).json()


def member(url: str, replica_url: str) -> dict | None:
    return next((r for r in state(url)["replicas"] if r["url"] == replica_url), None)


def served(replica_url: str) -> float:
    return metric(replica_url, "vllm:request_success_total")


def adapters_on(replica_url: str, token: str) -> set[str]:
    data = requests.get(replica_url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
    return {m["id"] for m in data["data"] if m.get("parent")}


PROMPTS = [random.Random(-i).choices(range(500), k=40) for i in range(1, 9)]  # tiny-qwen3: 512 ids


def test_replica_added_mid_traffic_serves_only_after_loading_the_live_adapters(elastic, adapters):
    url, b = elastic.url, elastic.b
    assert requests.post(url + "/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "trl-policy-v1", "lora_path": adapters["trl-policy-v1"]}).status_code == 200
    stop, errors, sent = threading.Event(), [], [0]

    def traffic():  # rollouts of the live adapter keep flowing while the new replica joins; new prompts, so some
        i = 0  # are unmatched and may go to the newcomer once it is in service
        while not stop.is_set():
            group = [trl_payload("trl-policy-v1", random.Random(4 * i + s).choices(range(500), k=40), s)
                     for s in range(4)]
            results = run_group(url, group)
            errors.extend(r for r in results if isinstance(r, Exception))
            sent[0] += 4
            i += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        wait_for(lambda: sent[0] >= 8, 30, "traffic under way")
        headers = {"Authorization": f"Bearer {elastic.admin}"}
        reply = requests.post(url + "/router/replicas", json={"url": b.url}, headers=headers, timeout=30)
        assert reply.status_code == 200 and reply.json()["added"] is True, reply.text
        assert reply.json()["state"] == "starting"  # joined out of routing
        # while its (lagging) adapter load runs it gets nothing
        observed, give_up = [], time.monotonic() + 60
        while (entry := member(url, b.url))["state"] != "in_service":
            observed.append((entry["state"], served(b.url), adapters_on(b.url, elastic.token)))
            assert time.monotonic() < give_up, observed[-3:]
            time.sleep(0.1)
        assert observed, "admitted before the first look: the storage lag should have held it out"
        assert all(n == 0 for _, n, _ in observed), observed  # not a completion before admission
        assert "trl-policy-v1" in adapters_on(b.url, elastic.token)
        wait_for(lambda: served(b.url) > 0, 30, "traffic reaching the new replica")
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not worker.is_alive() and not errors, errors
    assert metric(b.url, "grpo_replica_unknown_model_total") == 0  # never asked for an adapter it did not hold
    assert metric(url, "grpo_router_membership_changes_total") == 1


def test_removed_replica_gets_nothing_more_and_the_others_keep_their_prefixes(elastic):
    url, router = elastic.url, elastic.router.router
    assert member(url, elastic.b.url)["state"] == "in_service"  # the previous test added it
    for s, prompt in enumerate(PROMPTS):  # every prompt owned by one of the three replicas
        assert all(not isinstance(r, Exception) for r in run_group(url, [trl_payload("trl-policy-v1", prompt, s)]))
    index = {name: member(url, getattr(elastic, name).url)["index"] for name in "abc"}
    policy = router.pool.policy
    owned = elastic.router.call(lambda: {n: policy.owned_blocks(i) for n, i in index.items()})
    assert min(owned.values()) > 0, owned
    blocks_before = elastic.router.call(lambda: policy.num_blocks)
    # which prompts the two that stay hold: those must still be routed by affinity afterwards
    held = elastic.router.call(lambda: sum(
        max(policy._matches(policy.hashes_for(p, "trl-policy-v1"), [index["b"], index["c"]])) > 0 for p in PROMPTS))
    assert held > 0

    removed = elastic.router.remove_replica(elastic.a.url, drain_s=5)
    assert removed["state"] == "removed" and removed["cut"] == 0
    assert {r["url"] for r in state(url)["replicas"]} == {elastic.b.url, elastic.c.url}
    after = elastic.router.call(lambda: {n: policy.owned_blocks(i) for n, i in index.items()})
    assert after == {**owned, "a": 0}  # only the removed replica's ownership is gone
    assert elastic.router.call(lambda: policy.num_blocks) == blocks_before  # no record lost

    served_a = served(elastic.a.url)
    routing = state(url)["routing"]
    for s, prompt in enumerate(PROMPTS):
        results = run_group(url, [trl_payload("trl-policy-v1", prompt, 100 + s)])
        assert all(not isinstance(r, Exception) for r in results), results
    assert served(elastic.a.url) == served_a  # nothing more reached it
    delta = {k: v - routing[k] for k, v in state(url)["routing"].items()}
    assert delta["affinity"] == held, delta  # the prompts the others held still go to them
    gauges = [k for k in metrics_of(url) if k.startswith(("grpo_router_replica_state", "grpo_router_in_flight"))]
    assert gauges and not [k for k in gauges if elastic.a.url in k], gauges  # its gauges are gone

    # back again: re-admitted through the same path, with the live adapters
    added = elastic.router.add_replica(elastic.a.url, wait_s=60)
    assert added["state"] == "in_service" and added["index"] == index["a"]  # its number, reused
    assert "trl-policy-v1" in adapters_on(elastic.a.url, elastic.token)


def test_completions_running_on_a_removed_replica_finish_elsewhere(elastic):
    url = elastic.url
    payloads = [{**trl_payload("trl-policy-v1", list(range(300, 340)), seed=s, max_tokens=200), "ignore_eos": True}
                for s in range(3)]
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(run_group(url, payloads, timeout=120)))
    runner.start()
    busy = wait_for(lambda: [r for r in state(url)["replicas"] if r["in_flight"] == 3], 30, "the group in flight")[0]
    removed = elastic.router.remove_replica(busy["url"], drain_s=0)  # a replica that died: cut and re-send
    assert removed["cut"] == 3
    runner.join(timeout=150)
    assert len(results) == 3 and all(not isinstance(r, Exception) for r in results), results
    assert all(len(r["choices"][0]["token_ids"]) == 200 for r in results)
    assert 'reason="replica_down"' in requests.get(url + "/metrics", timeout=10).text
    elastic.router.add_replica(busy["url"], wait_s=60)
