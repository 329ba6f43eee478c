"""Supervision on Ray: `kill -9` of one replica's *server* process (what an OOM kill does; the actor is left to notice)
in the middle of an async-loop run. The replica leaves routing at once, the survivor's adapter slots are not filled
by what the dead replica left behind, Ray restarts the pair and the router re-admits it with the live adapters, and
the run finishes (issue 43, defect 3: it ended ~3 s after the kill with "cannot hold more than max_loras"). How the
survivor got overfilled (drains outlasting a sync while the loads come paused) depends on the machine's load, so the
defect itself is reproduced deterministically by `tests/serving/test_survivor_slots.py`; this is the whole path on
a real cluster, with the loop's router a supervised child process driven by Ray's watch over its admin API."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests
from ray_checks import adapters_on, live_placement_groups, metric, wait_no_live_actors, wait_torn_down

from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.tasks.embedded_model import embedded_model_dir
from step_actions import AtStep

ray = pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytestmark = pytest.mark.ray

STEPS, KILL_AT, MAX_STALENESS = 16, 7, 4
OUT_OF_ROUTING_S = 5.0  # a bound, far above the expected ~1 s, far below the health checks' 3 x 5 s timeouts


def server_pid(watchdog_pid: int) -> int:
    """The `cpu_replica` process itself: the watchdog's child is the guard, whose child is the server."""
    import psutil

    guard = psutil.Process(watchdog_pid).children()[0]
    server = guard.children()[0]
    assert "grpo_lab.serving.replicas.cpu_replica" in " ".join(server.cmdline())
    return server.pid



def test_a_replica_server_killed_mid_run_is_restarted_and_the_run_finishes(ray_cluster, tmp_path):
    args = embedded_trainer_args(str(tmp_path / "run"), max_steps=STEPS, max_staleness=MAX_STALENESS,
                                 save_strategy="no")
    # the router's health checks are left slow on purpose (their defaults): taking the dead replica out must not
    # wait for them
    loop = AsyncLoop(LoopConfig(
        replicas=2, launcher="ray", ray_address=ray_cluster.address, ray_resources={"replica_node": 1},
        model=str(embedded_model_dir()), ready_timeout_s=240,
        router={"load_retry_deadline_s": 10, "control_timeout_s": 60}), args, progress=False)
    loop.start()
    launcher, url = loop.cluster.replicas, loop.cluster.url
    first = launcher.infos()
    victim = first[0]
    seen = list(first)
    routed = lambda: {r["url"]: r["state"] for r in requests.get(url + "/router/state", timeout=10).json()["replicas"]}
    timings: dict = {}
    try:
        def kill_the_server():
            pid = server_pid(victim["server_pid"])
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)  # the server alone, as the kernel's OOM killer would
            while routed().get(victim["url"]) == "in_service":
                time.sleep(0.02)
            timings["out_of_routing_s"] = time.monotonic() - t0
            timings["killed_wall"] = time.time() - timings["out_of_routing_s"]

        loop.trainer.add_callback(AtStep(KILL_AT, kill_the_server))
        loop.train()
        trainer = loop.trainer
        assert "out_of_routing_s" in timings
        assert timings["out_of_routing_s"] < OUT_OF_ROUTING_S, timings

        # Ray restarted the pair; the router re-admitted the new incarnation with the live adapters
        deadline = time.monotonic() + 120
        while (back := launcher.infos()[0]) is None or back["incarnation"] == victim["incarnation"] \
                or routed().get(back["url"]) != "in_service":
            assert time.monotonic() < deadline, (launcher.events, routed())
            time.sleep(0.2)
        timings["back_s"] = next(t for t, what, u in launcher.events if what == "added" and u == back["url"]) \
            - timings["killed_wall"]
        seen.append(back)
        assert victim["url"] not in routed()

        rows = [r for r in read_metrics(tmp_path / "run" / METRICS_FILE) if "train_runtime" not in r]
        assert trainer.state.global_step == STEPS and [r["step"] for r in rows] == list(range(1, STEPS + 1))
        versions = [p["version"] for p in trainer.published]
        for r in rows:
            if "rollout/version_min" in r:
                assert versions[0] <= r["rollout/version_min"] <= r["rollout/version_max"] <= versions[-1]
        assert metric(url, "grpo_router_adapter_loads_total", result="failed") == 0
        live = {f"trl-policy-v{v}" for v in trainer._live_versions}
        for info in launcher.infos():
            deadline = time.monotonic() + 30
            while (held := adapters_on(info["url"])) != live:
                assert time.monotonic() < deadline and held > live, (held, live)
                time.sleep(0.2)
        assert metric(back["url"], "grpo_replica_unknown_model_total") == 0
        print(f"\n[ray tier] server kill -9: out of routing in {timings['out_of_routing_s']:.2f} s, "
              f"back in service {timings['back_s']:.1f} s after the kill; events {launcher.events}", flush=True)
    finally:
        loop.stop()
    assert wait_torn_down(seen) == []
    assert wait_no_live_actors(ray) == []
    assert live_placement_groups(ray) == []
