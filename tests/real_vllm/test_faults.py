"""A real vLLM replica killed while an adapter load is in flight: the router rolls the load back on the other one,
keeps serving from it, and re-admits the restarted replica with every live adapter loaded.

To kill it *during* its load (a tiny adapter loads in milliseconds) the replica is frozen (SIGSTOP) just before the
router's load reaches it; once the healthy replica has the adapter, the frozen one is SIGKILLed, so the router sees
its load fail mid-flight, as when a node dies.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests
from trl.experimental.async_grpo.vllm_client import VLLMClient

from .conftest import SERVED_NAME, served_models, trl_payload, unload

PROMPT = list(range(5, 45))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def state(url: str) -> dict:
    return requests.get(url + "/router/state", timeout=30).json()


@pytest.mark.kills_replica
def test_replica_killed_mid_load_leaves_routing_and_is_readmitted(cluster, adapters, token):
    """A replica killed mid-load cannot be reached: it leaves routing, the load stands on the healthy one (a trainer's
    sync does not fail because one replica died), and the replica gets the live set back at re-admission."""
    from grpo_lab.serving.replicas.processes import restart

    healthy, victim = cluster.replicas
    os.killpg(victim.pid, signal.SIGSTOP)
    answer: dict = {}

    def load():
        answer["response"] = requests.post(cluster.url + "/v1/load_lora_adapter", timeout=120, json={
            "lora_name": "trl-policy-v1", "lora_path": adapters["trl-policy-v1"], "load_inplace": False})

    loader = threading.Thread(target=load)
    loader.start()
    try:
        wait_for(lambda: "trl-policy-v1" in served_models(healthy, token), 30, "the healthy replica's load")
    finally:
        victim.kill()  # SIGKILL to the stopped group: the router's request to it dies mid-load
    loader.join(timeout=120)

    response = answer["response"]
    assert response.status_code == 200, response.text
    after = state(cluster.url)
    assert "trl-policy-v1" in after["live_adapters"] and "trl-policy-v1" in served_models(healthy, token)
    assert [r["state"] for r in after["replicas"]][1] != "in_service", after

    # training goes on with one replica: a sync and rollouts
    client = VLLMClient(cluster.url)
    client.pause()
    client.load_lora_adapter("trl-policy-v2", adapters["trl-policy-v2"])
    client.resume()
    for seed in range(3):
        reply = requests.post(cluster.url + "/v1/completions", json=trl_payload("trl-policy-v2", PROMPT, seed),
                              timeout=120)
        assert reply.status_code == 200, reply.text

    # the replica comes back (same port) and the router re-admits it holding the live adapter
    fresh = restart(victim, env={"VLLM_API_KEY": token})
    cluster.replicas[1] = fresh  # the session fixture stops this one at the end
    try:
        wait_for(lambda: [r["state"] for r in state(cluster.url)["replicas"]] == ["in_service"] * 2, 120,
                 "re-admission")
        assert {"trl-policy-v1", "trl-policy-v2"} <= set(served_models(fresh, token))  # the live set, both
        # and the re-admitted replica serves the adapter exactly as the other one does
        payload = trl_payload("trl-policy-v2", PROMPT, seed=11)
        mine = [requests.post(r.url + "/v1/completions", json=payload, timeout=120,
                              headers={"Authorization": f"Bearer {token}"}).json()["choices"][0]["token_ids"]
                for r in (healthy, fresh)]
        assert mine[0] == mine[1]
    finally:
        for name in ("trl-policy-v2", "trl-policy-v1"):
            unload(cluster, token, name)
    for r in (healthy, fresh):
        assert served_models(r, token) == {SERVED_NAME, "trl-policy-v0"}
