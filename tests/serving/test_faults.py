"""Fault tests on real processes: storage lag, a replica killed during a load or mid-generation, a restart."""

from __future__ import annotations

import threading
import time
import types

import pytest
import requests
from trl.experimental.async_grpo.vllm_client import VLLMClient

from grpo_lab.serving.replicas.processes import CPUReplicaProcess, restart
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router

from .conftest import REPLICA_ARGS, TOKEN_ENV, metric, run_group, trl_payload, wait_for

LAG_S = 1.0
PROMPT = list(range(100, 150))


@pytest.fixture(scope="module")
def faulty(token):
    from accelerate import PartialState

    PartialState()
    env = {"VLLM_API_KEY": token}
    a = CPUReplicaProcess(["--port", "0", *REPLICA_ARGS], env)
    b = CPUReplicaProcess(["--port", "0", *REPLICA_ARGS, "--storage-lag-s", str(LAG_S)], env)  # a lagging mount
    a.wait_ready(), b.wait_ready()
    router = start_router(RouterConfig(replicas=[a.url, b.url], port=0, api_key_env=TOKEN_ENV,
                                       health_interval_s=0.2, health_timeout_s=2, load_retry_deadline_s=15,
                                       load_retry_interval_s=0.05, control_timeout_s=30, upstream_timeout_s=60))
    ns = types.SimpleNamespace(router=router, replicas=[a, b], url=None, env=env, token=token)
    try:
        router.wait_ready(2, timeout=60)
        ns.url = router.url
        yield ns
    finally:
        router.stop()
        for r in ns.replicas:
            r.stop()


def state(cluster) -> dict:
    return requests.get(cluster.url + "/router/state", timeout=10).json()


def replica_state(cluster, i: int) -> str:
    return state(cluster)["replicas"][i]["state"]


def adapters_on(cluster, i: int) -> set[str]:
    r = cluster.replicas[i]
    data = requests.get(r.url + "/v1/models", headers={"Authorization": f"Bearer {cluster.token}"}, timeout=10)
    return {m["id"] for m in data.json()["data"] if m.get("parent")}


def restart_replica(cluster, i: int) -> None:
    cluster.replicas[i] = restart(cluster.replicas[i], cluster.env)
    wait_for(lambda: replica_state(cluster, i) == "in_service", 60, f"replica {i} re-admitted")


def test_lagging_storage_is_retried_then_succeeds(faulty, adapters):
    client = VLLMClient(faulty.url)
    t0 = time.monotonic()
    client.load_lora_adapter("trl-policy-v1", adapters["trl-policy-v1"])
    assert time.monotonic() - t0 >= LAG_S * 0.9  # it waited for the lagging replica
    retries = metric(faulty.url, "grpo_router_adapter_load_retries_total")
    assert retries >= 1
    assert adapters_on(faulty, 0) == adapters_on(faulty, 1) == {"trl-policy-v1"}
    bodies = run_group(faulty.url, [trl_payload("trl-policy-v1", PROMPT, s) for s in range(4)])
    assert all(not isinstance(b, Exception) for b in bodies), bodies


@pytest.mark.slow
def test_replica_killed_mid_generation_is_rerouted(faulty):
    # ignore_eos keeps every rollout long enough to be cut; the rest is TRL's payload
    payloads = [{**trl_payload("trl-policy-v0", list(range(300, 340)), seed=s, max_tokens=200), "ignore_eos": True}
                for s in range(3)]
    results: list = []
    tokens_before = [metric(r.url, "vllm:generation_tokens_total") for r in faulty.replicas]
    runner = threading.Thread(target=lambda: results.extend(run_group(faulty.url, payloads, timeout=90)))
    t0 = time.monotonic()
    runner.start()
    busy = wait_for(lambda: [i for i, r in enumerate(state(faulty)["replicas"]) if r["in_flight"] == 3],
                    20, "the group in flight on one replica")[0]
    victim = faulty.replicas[busy]
    wait_for(lambda: metric(victim.url, "vllm:generation_tokens_total") > tokens_before[busy], 20, "decoding under way")
    victim.kill()
    runner.join(timeout=100)
    assert not runner.is_alive(), "a request hung after its replica died"
    assert len(results) == 3 and all(not isinstance(r, Exception) for r in results), results
    for r in results:  # finished on the other replica
        choice = r["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 200
    assert time.monotonic() - t0 < 90
    assert replica_state(faulty, busy) == "down"
    assert metric(faulty.url, "grpo_router_reroutes_total") >= 3
    assert requests.get(faulty.url + "/health", timeout=10).status_code == 200  # the survivor serves alone
    restart_replica(faulty, busy)
    assert adapters_on(faulty, busy) == set(state(faulty)["live_adapters"])  # re-admitted with the live adapters


def test_replica_killed_during_load_leaves_routing_and_the_load_stands(faulty, adapters):
    """A replica that dies mid-load cannot be reached: it leaves routing, the load succeeds on the replicas left
    (so a trainer's sync does not fail because one replica died), and the replica gets the adapter back only with
    the live set at its re-admission."""
    client = VLLMClient(faulty.url)
    before = metric(faulty.url, "grpo_router_adapter_load_retries_total")
    outcome: dict = {}

    def load():
        try:
            client.load_lora_adapter("trl-policy-v2", adapters["trl-policy-v2"])
            outcome["ok"] = True
        except Exception as error:  # what the trainer would see
            outcome["error"] = str(error)

    loader = threading.Thread(target=load)
    loader.start()
    # replica 1 lags: once it has answered "No adapter found", replica 0 has taken the load
    wait_for(lambda: metric(faulty.url, "grpo_router_adapter_load_retries_total") > before
             or "trl-policy-v2" in adapters_on(faulty, 0), 10, "the load in progress")
    faulty.replicas[1].kill()
    loader.join(timeout=40)
    assert not loader.is_alive()
    assert outcome.get("ok"), outcome
    assert "trl-policy-v2" in adapters_on(faulty, 0) and "trl-policy-v2" in state(faulty)["live_adapters"]
    assert replica_state(faulty, 1) != "in_service"
    reply = requests.post(faulty.url + "/v1/completions", json=trl_payload("trl-policy-v2", PROMPT, 1), timeout=30)
    assert reply.status_code == 200  # served by the replica that holds it
    restart_replica(faulty, 1)  # and waits until it is in service again
    assert "trl-policy-v2" in adapters_on(faulty, 1)  # re-admitted with the live set
    assert metric(faulty.replicas[0].url, "grpo_replica_unknown_model_total") == 0
    client.unload_lora_adapter("trl-policy-v2")  # the module's later tests start from the live set before it


@pytest.mark.slow
def test_restarted_replica_is_readmitted_only_with_live_adapters(faulty, adapters):
    client = VLLMClient(faulty.url)
    faulty.replicas[1].kill()
    wait_for(lambda: replica_state(faulty, 1) == "down", 10, "replica 1 out of routing")
    client.load_lora_adapter("trl-policy-v3", adapters["trl-policy-v3"])  # while replica 1 is down
    client.unload_lora_adapter("trl-policy-v1")
    live = set(state(faulty)["live_adapters"])
    assert live == {"trl-policy-v3"}
    stop = threading.Event()
    errors: list = []

    def traffic():  # rollouts of the newest policy keep flowing while replica 1 rejoins
        while not stop.is_set():
            for r in run_group(faulty.url, [trl_payload("trl-policy-v3", PROMPT, s) for s in range(4)]):
                if isinstance(r, Exception):
                    errors.append(r)

    worker = threading.Thread(target=traffic)
    worker.start()
    fresh = restart(faulty.replicas[1], faulty.env)
    faulty.replicas[1] = fresh
    wait_for(lambda: replica_state(faulty, 1) == "in_service", 60, "replica 1 re-admitted")
    assert live <= adapters_on(faulty, 1)  # adapters are only ever added by the router, so this held at admission
    stop.set()
    worker.join(timeout=60)
    assert not worker.is_alive() and not errors, errors
    assert adapters_on(faulty, 1) == live  # the live set, nothing stale
    assert metric(fresh.url, "grpo_replica_unknown_model_total") == 0
    assert metric(faulty.url, "grpo_router_readmissions_total") >= 1
    # its prefix ownership was cleared on admission, so the first group of a known prompt is not pinned there
    router = faulty.router.router
    idx = 1
    owned = faulty.router.call(lambda: router.pool.policy.owned_blocks(idx))
    bodies = run_group(faulty.url, [trl_payload("trl-policy-v3", PROMPT, s) for s in range(2)])
    assert all(not isinstance(b, Exception) for b in bodies)
    assert owned <= len(PROMPT) // 16  # at most what traffic since admission gave it
