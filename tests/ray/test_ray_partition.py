"""A partition between the head and the worker while the cluster serves: the worker's cable is pulled (link down on
its veth) for longer than the router's per-try deadline. The completions the router had sent to the worker's replica
are hedged or re-sent to the head's replica and every one is answered; the router takes the worker's replica out of
routing; Ray keeps both nodes (the partition is shorter than its node timeout: 5 failed health checks 3 s apart);
after healing, the same replica (no restart) is admitted again and served."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from ray_checks import live_placement_groups, wait_no_live_actors, wait_torn_down
from two_nodes import WORKER

from grpo_lab.serving.clusters.ray_actor import ServerSpec
from grpo_lab.serving.clusters.ray_replicas import RayReplicas
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.routing.per_try import PerTryConfig
from grpo_lab.serving.router.thread import start_router
from grpo_lab.serving.wire.metrics import parse_text

ray = pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytestmark = pytest.mark.ray

PER_TRY_S = 1.0  # the router's per-try deadline (its cap: no latencies are known yet)
UNAVAILABLE_S = 3.0  # the launcher unroutes an actor that has not answered for this long (so does a failed /health)
PARTITION_S = 8.0  # longer than both, well below Ray's node timeout
REQUESTS = 16  # sent at once right after the cable is pulled; round robin sends half to the worker
CLIENT_TIMEOUT_S = 60.0  # every completion must be answered within this (the router's own deadline is the same)


def complete(url: str, n: int, tag: int) -> list[int]:
    """`n` completions at once through the router; their status codes."""
    def one(i: int) -> int:
        return requests.post(url + "/v1/completions", json={"model": "fake", "prompt": [tag, i, 1, 2], "max_tokens": 3},
                             timeout=CLIENT_TIMEOUT_S).status_code

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def metric(url: str, name: str) -> float:
    values = parse_text(requests.get(url + "/metrics", timeout=10).text)
    return sum(v for k, v in values.items() if k.split("{")[0] == name)


def served(replica_url: str) -> int:
    return requests.get(replica_url + "/served", timeout=10).json()["n"]


def state_of(router, url: str) -> str | None:
    return next((r["state"] for r in router.replicas() if r["url"] == url), None)


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)
    return value


def test_a_partitioned_worker_is_routed_around_and_admitted_again_after_healing(ray_cluster):
    network = ray_cluster.network
    replicas = RayReplicas(2, ServerSpec("fake"), strategy="STRICT_SPREAD", poll_s=0.2, unavailable_s=UNAVAILABLE_S)
    with replicas:
        infos = replicas.infos()
        by_node = {i["node_id"]: i for i in infos}
        assert set(by_node) == {ray_cluster.head_node, ray_cluster.worker_node}  # one replica on each host
        on_head, on_worker = by_node[ray_cluster.head_node], by_node[ray_cluster.worker_node]
        assert on_worker["url"].startswith(f"http://{ray_cluster.worker_ip}:")
        router = start_router(RouterConfig(
            replicas=replicas.urls, port=0, routing_policy="round_robin", health_interval_s=0.2,
            health_timeout_s=UNAVAILABLE_S, upstream_timeout_s=CLIENT_TIMEOUT_S,
            per_try=PerTryConfig(floor_s=0.5, cap_s=PER_TRY_S)))
        try:
            router.wait_ready(timeout=30)
            replicas.watch(router)
            assert complete(router.url, REQUESTS, 1) == [200] * REQUESTS
            assert served(on_worker["url"]) > 0  # the worker's replica serves across the link
            retried_before = metric(router.url, "grpo_router_hedges_total") + \
                metric(router.url, "grpo_router_reroutes_total")

            network.partition(WORKER)
            pulled_at = time.monotonic()
            try:
                during = complete(router.url, REQUESTS, 2)
                answered_s = time.monotonic() - pulled_at
                wait_until(lambda: state_of(router, on_worker["url"]) != "in_service", 30,
                           "the router takes the partitioned replica out of routing")
                time.sleep(max(0.0, PARTITION_S - (time.monotonic() - pulled_at)))
                assert state_of(router, on_worker["url"]) != "in_service"  # still cut off: not admitted meanwhile
            finally:
                network.heal(WORKER)
            # every completion was answered, those sent to the worker by the head's replica after their try's
            # deadline (a hedge) or the replica's removal (a re-send)
            assert during == [200] * REQUESTS
            assert metric(router.url, "grpo_router_hedges_total") + \
                metric(router.url, "grpo_router_reroutes_total") > retried_before

            # healed: the same replica (same URL, same incarnation: Ray did not restart it) is admitted again
            wait_until(lambda: state_of(router, on_worker["url"]) == "in_service", 90,
                       "the healed replica is admitted again")
            assert replicas.infos()[on_worker["index"]]["incarnation"] == on_worker["incarnation"]
            assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} >= {ray_cluster.head_node,
                                                                         ray_cluster.worker_node}
            before_heal = served(on_worker["url"])
            assert complete(router.url, REQUESTS, 3) == [200] * REQUESTS
            assert served(on_worker["url"]) > before_heal  # routed to again
            print(f"\n[ray tier] partition {PARTITION_S:.0f} s: {REQUESTS} completions answered in "
                  f"{answered_s:.1f} s; launcher events {[e[1] for e in replicas.events]}", flush=True)
        finally:
            replicas.stop()
            router.stop()
    assert wait_torn_down([on_head, on_worker]) == []
    assert wait_no_live_actors(ray) == []
    assert live_placement_groups(ray) == []
