"""The async loop with its replicas on the worker node of a real two-node Ray cluster: TRL's AsyncGRPOTrainer (on the
head node's host) -> adapters on storage -> the router -> across the worker's link -> two CPU replica actors; one actor is killed mid-run, Ray restarts it, the router
re-admits it only once it holds the live adapters, and the run finishes with nothing left behind."""

from __future__ import annotations

import math
import time

import psutil
import pytest
import requests
from ray_checks import adapters_on, live_placement_groups, metric, wait_no_live_actors, wait_torn_down

from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.serving.clusters.launcher import RayActors
from grpo_lab.tasks.embedded_model import embedded_model_dir
from step_actions import AtStep

ray = pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytestmark = pytest.mark.ray

STEPS, KILL_AT, BACK_BY, MAX_STALENESS = 10, 2, 6, 4


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False



def test_async_loop_on_a_two_node_ray_cluster_survives_a_replica_restart(ray_cluster, tmp_path):
    """`LoopConfig(launcher="ray")` (what `grpo-lab async-loop --launcher ray --ray-address ...` builds)."""
    t0 = time.monotonic()
    args = embedded_trainer_args(str(tmp_path / "run"), max_steps=STEPS, max_staleness=MAX_STALENESS,
                                 save_strategy="no")
    loop = AsyncLoop(LoopConfig(
        replicas=2, launcher="ray", ray_address=ray_cluster.address, ray_resources={"replica_node": 1},
        model=str(embedded_model_dir()), ready_timeout_s=240,
        router={"health_interval_s": 0.2, "load_retry_deadline_s": 10, "control_timeout_s": 60}), args, progress=False)
    loop.start()
    cluster = loop.cluster
    assert isinstance(cluster.placement, RayActors)  # the one launcher, its replicas placed by Ray
    started_s = time.monotonic() - t0
    launcher, url = cluster.replicas, cluster.url
    first = launcher.infos()
    seen = list(first)
    victim = first[0]
    try:
        assert {i["node_id"] for i in first} == {ray_cluster.worker_node}  # on the worker node, not the head
        # at the worker's own address: the router (on the head, in this process) reaches them across the link
        assert all(i["url"].startswith(f"http://{ray_cluster.worker_ip}:") for i in first), first
        routed = lambda: {r["url"]: r["state"] for r in requests.get(url + "/router/state", timeout=10).json()["replicas"]}

        def kill_one_replica():
            ray.kill(launcher.slots[0].actor, no_restart=False)  # Ray restarts it (max_restarts)
            deadline = time.monotonic() + 15
            while routed().get(victim["url"]) == "in_service":  # out of routing before the next weight sync
                assert time.monotonic() < deadline, routed()
                time.sleep(0.05)

        def back_in_service(timeout: float = 120.0) -> dict:
            """The killed replica's new incarnation, once the router routes to it."""
            deadline = time.monotonic() + timeout
            while (info := launcher.infos()[0]) is None or info["incarnation"] == victim["incarnation"] \
                    or routed().get(info["url"]) != "in_service":
                assert time.monotonic() < deadline, (launcher.events, routed())
                time.sleep(0.2)
            return info

        kill = AtStep(KILL_AT, kill_one_replica)  # steps KILL_AT+1.. train on one replica while Ray restarts the other
        back: list = []
        rejoined = AtStep(BACK_BY, lambda: back.append(back_in_service()))  # the last steps use both again
        worker_pid = []
        for callback in (kill, rejoined, AtStep(1, lambda: worker_pid.append(loop.trainer.rollout_worker.pid))):
            loop.trainer.add_callback(callback)
        t1 = time.monotonic()
        loop.train()
        train_s = time.monotonic() - t1
        assert kill.done and back
        trainer = loop.trainer

        # Ray restarted the actor; the launcher removed the dead URL and added the new one
        back = back[0]
        seen.append(back)
        assert back["node_id"] == ray_cluster.worker_node and back["url"] != victim["url"]
        assert victim["url"] not in routed()
        assert [e[1] for e in launcher.events] == ["removed", "added"]

        # the run: every step, every completion from a version this trainer published, within max_staleness
        rows = [r for r in read_metrics(tmp_path / "run" / METRICS_FILE) if "train_runtime" not in r]
        assert trainer.state.global_step == STEPS and [r["step"] for r in rows] == list(range(1, STEPS + 1))
        versions = [p["version"] for p in trainer.published]
        assert versions == list(range(versions[0], versions[0] + STEPS + 1))
        for r in rows:
            assert r["sample/staleness_max"] <= MAX_STALENESS
            if "rollout/version_min" in r:
                assert versions[0] <= r["rollout/version_min"] <= r["rollout/version_max"] <= versions[-1]
            assert 0.9 <= r["ratio"] <= 1.1 and math.isfinite(r["loss"])

        # every version loaded on every replica in service (all-or-nothing, none failed); both hold the live set
        assert metric(url, "grpo_router_adapter_loads_total", result="ok") == len(versions)
        assert metric(url, "grpo_router_adapter_loads_total", result="failed") == 0
        live = {f"trl-policy-v{v}" for v in trainer._live_versions}
        for info in launcher.infos():  # exactly the live set, once the last unload's drain has finished
            deadline = time.monotonic() + 30
            while (held := adapters_on(info["url"])) != live:
                assert time.monotonic() < deadline and held > live, (held, live)
                time.sleep(0.2)
        # the restarted replica was routed to only once it held the live adapters: it never saw a request for an
        # adapter it lacked, and the router never had to re-send one for a lost adapter
        assert metric(back["url"], "grpo_replica_unknown_model_total") == 0
        assert metric(back["url"], "vllm:request_success_total") > 0
        assert metric(url, "grpo_router_reroutes_total", reason="lost_adapter") == 0
        assert metric(url, "grpo_router_membership_changes_total") == 2
        assert worker_pid and _gone(worker_pid[0])  # TRL's rollout worker process ended with the run
        print(f"\n[ray tier] cluster start {started_s:.1f} s, {STEPS} steps {train_s:.1f} s, restart: "
              f"{launcher.events[1][0] - launcher.events[0][0]:.1f} s from removal to re-adding", flush=True)
    finally:
        loop.stop()
    assert wait_torn_down(seen) == []  # no actor process, no server (either incarnation)
    assert wait_no_live_actors(ray) == []
    assert live_placement_groups(ray) == []
