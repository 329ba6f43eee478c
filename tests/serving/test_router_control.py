"""The router's control path against fake replicas (`fake_vllm`): malformed answers, failed unloads and rollbacks,
cancelled loads, adapters a replica should not hold, and a router that cannot bind its port."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
import pytest
import requests

from grpo_lab.serving.adapters import fanout as adapter_fanout
from grpo_lab.serving.adapters.fanout import load_everywhere
from grpo_lab.serving.wire.metrics import Registry
from grpo_lab.serving.router.replica_pool import ReplicaPool
from grpo_lab.serving.router.thread import RouterHandle, start_router
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.wire.upstream import DOWN, IN_SERVICE, Replica, UpstreamClient

from .conftest import TOKEN_ENV, metric, wait_for
from .fake_vllm import FakeCluster, FakeVLLM


@contextlib.contextmanager
def router_for(*fakes: FakeVLLM, health_interval_s: float = 0.05):
    config = RouterConfig(replicas=[f.url for f in fakes], port=0, api_key_env=TOKEN_ENV,
                          health_interval_s=health_interval_s, health_timeout_s=2, load_retry_deadline_s=1,
                          control_timeout_s=5, upstream_timeout_s=5)
    handle = start_router(config)
    try:
        handle.wait_ready(timeout=10)
        yield handle.url
    finally:
        handle.stop()


def states(url: str) -> list[str]:
    return [r["state"] for r in requests.get(url + "/router/state", timeout=5).json()["replicas"]]


def load(url: str, name: str) -> requests.Response:
    return requests.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/p/{name}"},
                         timeout=10)


def complete(url: str, prompt: list[int]) -> requests.Response:
    return requests.post(url + "/v1/completions", json={"model": "m", "prompt": prompt}, timeout=10)


def run_with_client(fn):
    """Run `fn(client)` on a fresh event loop with an authenticated upstream client."""
    async def go():
        async with aiohttp.ClientSession() as session:
            return await fn(UpstreamClient(session, "tok-test"))
    return asyncio.run(go())


# -- malformed answers are transport errors ---------------------------------------------------------------------
def test_malformed_answer_is_a_transport_error():
    fake = FakeVLLM()
    fake.malformed = True

    async def probe(client):
        replica = Replica(0, fake.url)
        one = await adapter_fanout.load_one(client, replica, "v1", "/p/v1", deadline_s=1, interval_s=0.01,
                                            timeout_s=5)
        return await client.healthy(replica, timeout=5), one

    with FakeCluster(fake):
        healthy, outcome = run_with_client(probe)
    assert healthy is False
    assert not outcome.ok and outcome.transport_error and outcome.status == 502


def test_malformed_replica_leaves_routing_and_the_load_stands(token):
    """Malformed HTTP is a transport error: the replica is treated as unreachable, leaves routing, and the load
    stands on the replica left in service (it gets the live set back only at re-admission)."""
    good, broken = FakeVLLM(), FakeVLLM()
    with FakeCluster(good, broken), router_for(good, broken) as url:
        broken.malformed = True
        reply = load(url, "v1")
        assert reply.status_code == 200, reply.text
        assert token not in reply.text
        assert "v1" in good.adapters
        assert states(url) == [IN_SERVICE, DOWN]
        assert "v1" in requests.get(url + "/router/state", timeout=5).json()["live_adapters"]
        assert requests.get(url + "/health", timeout=5).status_code == 200


def test_completion_to_a_malformed_replica_is_rerouted(token):
    good, broken = FakeVLLM(), FakeVLLM()
    with FakeCluster(good, broken), router_for(good, broken, health_interval_s=60) as url:  # no health check helps
        broken.malformed = True
        replies = [complete(url, list(range(i * 100, i * 100 + 40))) for i in range(4)]  # round robin hits both
        assert [r.status_code for r in replies] == [200] * 4
        assert {r.json()["port"] for r in replies} == {good.port}
        assert states(url) == [IN_SERVICE, DOWN]
        assert metric(url, "grpo_router_reroutes_total") >= 1


# -- all-or-nothing loads whatever happens ------------------------------------------------------------------------
def test_load_everywhere_rolls_back_when_one_replica_raises(monkeypatch):
    a, b = FakeVLLM(), FakeVLLM()
    real = adapter_fanout.load_one

    async def buggy_on_b(client, replica, *args, **kwargs):
        if replica.url == b.url:
            raise RuntimeError("unexpected")
        return await real(client, replica, *args, **kwargs)

    monkeypatch.setattr(adapter_fanout, "load_one", buggy_on_b)
    with FakeCluster(a, b):
        replicas = [Replica(0, a.url), Replica(1, b.url)]
        ok, outcomes = run_with_client(lambda client: load_everywhere(
            client, replicas, "v1", "/p/v1", deadline_s=1, interval_s=0.01, timeout_s=5))
    assert not ok
    assert not outcomes[1].ok and outcomes[1].status == 502 and "RuntimeError" in outcomes[1].message
    assert a.adapters == {}  # rolled back
    assert all("v1" not in r.adapters for r in replicas)


def test_load_everywhere_rolls_back_when_cancelled():
    a, b = FakeVLLM(), FakeVLLM()
    b.load_delay_s = 30  # still loading when the caller gives up

    async def cancel_midway(client):
        replicas = [Replica(0, a.url), Replica(1, b.url)]
        task = asyncio.create_task(load_everywhere(client, replicas, "v1", "/p/v1", deadline_s=1, interval_s=0.01,
                                                   timeout_s=60))
        while "v1" not in a.adapters:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with FakeCluster(a, b):
        run_with_client(lambda client: asyncio.wait_for(cancel_midway(client), 10))
        assert a.adapters == {}


def test_failed_rollback_takes_the_replica_out_until_it_has_unloaded(token):
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a, b) as url:
        b.fail_next("/v1/load_lora_adapter", 400, "bad adapter")
        a.fail_next("/v1/unload_lora_adapter", 500, "engine busy")
        reply = load(url, "v1")
        assert reply.status_code == 400
        message = reply.json()["error"]["message"]
        assert f"the rollback failed on {a.url}" in message and "no replica in service serves it" in message
        wait_for(lambda: a.adapters == {} and states(url) == [IN_SERVICE, IN_SERVICE], 10,
                 "re-admission unloading v1")
        assert metric(url, "grpo_router_readmissions_total") >= 1
        assert requests.get(url + "/router/state", timeout=5).json()["live_adapters"] == []


# -- no adapter left behind ---------------------------------------------------------------------------------------
def test_failed_unload_takes_the_replica_out_until_it_has_unloaded(token):
    a, b = FakeVLLM(max_loras=2), FakeVLLM(max_loras=2)
    with FakeCluster(a, b), router_for(a, b) as url:
        assert load(url, "v1").status_code == 200
        b.fail_next("/v1/unload_lora_adapter", 500, "transient engine error")
        reply = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "v1"}, timeout=10)
        assert reply.status_code == 200  # answered at once; the upstream unload follows the drain
        wait_for(lambda: metric(url, "grpo_router_replica_failures_total") >= 1, 10,
                 "replica b out after its unload failed")
        wait_for(lambda: b.adapters == {} and states(url) == [IN_SERVICE, IN_SERVICE], 10,
                 "re-admission unloading v1")
        assert load(url, "v2").status_code == 200
        assert load(url, "v3").status_code == 200  # the slot v1 held is free again
        assert a.adapters == b.adapters == {"v2": "/p/v2", "v3": "/p/v3"}


def test_replica_holding_an_adapter_that_is_not_live_is_cleaned_up(token):
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a, b) as url:
        b.adapters["orphan"] = "/p/orphan"  # e.g. a load that finished there after its rollback
        wait_for(lambda: b.adapters == {} and states(url) == [IN_SERVICE, IN_SERVICE], 10, "the orphan unloaded")
        assert metric(url, "grpo_router_readmissions_total") >= 1


def test_adapter_check_ignores_an_answer_that_overlapped_a_control_operation():
    fake = FakeVLLM()
    fake.adapters["v9"] = "/p/v9"
    fake.models_delay_s = 0.3

    async def go(client):
        pool = ReplicaPool(RouterConfig(replicas=[fake.url]), client, Registry())
        replica = pool.replicas[0]
        replica.state = IN_SERVICE
        check = asyncio.create_task(pool._check_adapters(replica))
        await asyncio.sleep(0.1)
        replica.begin_transition("v9")  # e.g. an unload of v9 that began and ended while /v1/models was answering
        replica.end_transition("v9")
        await check
        overlapped = replica.state
        await pool._check_adapters(replica)
        return overlapped, replica.state

    with FakeCluster(fake):
        assert run_with_client(go) == (IN_SERVICE, DOWN)


# -- lifecycle ---------------------------------------------------------------------------------------------------
def test_router_that_cannot_bind_releases_its_session_tasks_and_loop():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        handle = RouterHandle(RouterConfig(replicas=["http://127.0.0.1:9"], port=taken.getsockname()[1]))
        with pytest.raises(RuntimeError, match="failed to start"):
            handle.start()
    router = handle.router
    assert router._session is not None and router._session.closed
    assert router._tasks and all(task.done() for task in router._tasks)
    assert handle._loop.is_closed()
    handle._thread.join(5)
    assert not handle._thread.is_alive()
