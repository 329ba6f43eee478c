"""The Ray launcher on a real two-node cluster: replicas land on the node that has their resource, report where they
are, come back when their server or actor dies (and the router follows), and leave no actor, server or placement
group behind on a normal exit, an exception, Ctrl-C or a kill -9 of the process that started them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from ray_checks import group_members, live_placement_groups, wait_no_live_actors, wait_torn_down

from grpo_lab.serving.clusters.ray_actor import ServerSpec
from grpo_lab.serving.clusters.ray_placement import PlacementError
from grpo_lab.serving.clusters.ray_replicas import RayReplicas
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router

ray = pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytestmark = pytest.mark.ray
DRIVER = Path(__file__).with_name("driver.py")


def fake_replicas(n: int = 2) -> RayReplicas:
    return RayReplicas(n, ServerSpec("fake"), resources={"replica_node": 1}, poll_s=0.2, unavailable_s=1.0)


def assert_gone(infos: list[dict]) -> None:
    assert wait_torn_down(infos) == []
    assert wait_no_live_actors(ray) == []
    assert live_placement_groups(ray) == []


def test_replicas_land_on_the_worker_node_and_a_normal_exit_leaves_nothing(ray_cluster):
    with fake_replicas() as replicas:
        infos = replicas.infos()
        assert {i["node_id"] for i in infos} == {ray_cluster.worker_node}  # the node with `replica_node`
        # each at the worker's own address, answering this process (on the head's host) across the link
        assert all(i["url"].startswith(f"http://{ray_cluster.worker_ip}:") for i in infos), infos
        assert all(requests.get(i["url"] + "/health", timeout=5).status_code == 200 for i in infos)
        assert replicas.urls == [i["url"] for i in infos]
        assert all(group_members(i["server_pid"]) for i in infos)
    assert_gone(infos)


def test_an_exception_leaves_nothing(ray_cluster):
    seen = []
    with pytest.raises(RuntimeError, match="trainer failed"), fake_replicas() as replicas:
        seen = replicas.infos()
        raise RuntimeError("trainer failed")
    assert seen
    assert_gone(seen)


def test_a_placement_that_cannot_be_met_is_a_clear_error_and_leaves_nothing(ray_cluster):
    impossible = RayReplicas(2, ServerSpec("fake"), resources={"replica_node": 1}, strategy="STRICT_SPREAD",
                             ready_timeout_s=3)  # two replicas, one node with the resource
    with pytest.raises(PlacementError, match=r"\(STRICT_SPREAD\): 2 nodes must offer that, and 1 does"):  # at once
        impossible.start()
    assert live_placement_groups(ray) == []


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl_c", "kill_9"])
def test_the_driver_interrupted_or_killed_leaves_nothing(ray_cluster, sig):
    driver = subprocess.Popen([sys.executable, str(DRIVER), ray_cluster.address], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = driver.stdout.readline()
        assert line, driver.stderr.read()[-2000:]
        infos = json.loads(line)
        assert {i["node_id"] for i in infos} == {ray_cluster.worker_node}
        assert wait_no_live_actors(ray, timeout=0) != []  # they are up
        driver.send_signal(sig)
        driver.wait(60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
    if sig == signal.SIGINT:
        assert driver.returncode != 0  # KeyboardInterrupt, after the `with` block stopped everything
    assert_gone(infos)


def test_a_dead_server_or_actor_is_restarted_and_the_router_follows(ray_cluster):
    with fake_replicas() as replicas:
        router = start_router(RouterConfig(replicas=replicas.urls, port=0, health_interval_s=0.1))
        try:
            router.wait_ready(timeout=30)
            replicas.watch(router)
            first = replicas.infos()
            # 1. the server dies on its own (its actor ends itself and Ray restarts both)
            os.killpg(first[0]["server_pid"], signal.SIGKILL)
            back = _wait_back(replicas, router, 0, first[0]["incarnation"])
            assert back["url"] != first[0]["url"] and back["node_id"] == ray_cluster.worker_node
            # 2. the actor is killed (Ray restarts it: no_restart=False)
            ray.kill(replicas.slots[1].actor, no_restart=False)
            again = _wait_back(replicas, router, 1, first[1]["incarnation"])
            assert again["url"] != first[1]["url"]
            members = {r["url"]: r["state"] for r in router.replicas()}
            assert members == {back["url"]: "in_service", again["url"]: "in_service"}  # the old URLs are gone
            assert [e[1] for e in replicas.events] == ["removed", "added", "removed", "added"]
            answer = requests.post(router.url + "/v1/completions", json={"model": "fake", "prompt": [1, 2, 3]},
                                   timeout=10)
            assert answer.status_code == 200
            assert wait_torn_down(first) == []  # the first incarnations' servers went with their actors
        finally:
            replicas.stop()
            router.stop()
    assert_gone(replicas_infos := [back, again])
    assert replicas_infos


def _wait_back(replicas: RayReplicas, router, index: int, old: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = replicas.infos()[index]
        if info is not None and info["incarnation"] != old:
            if any(r["url"] == info["url"] and r["state"] == "in_service" for r in router.replicas()):
                return info
        time.sleep(0.1)
    raise AssertionError(f"replica {index} not back in the router after {timeout}s: {replicas.events}")
