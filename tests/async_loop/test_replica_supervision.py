"""Supervision under the local launcher (issue 43, "supervision, not luck"): `kill -9` of one CPU replica's server
process (what the OOM killer does) in the middle of an async-loop run. The launcher sees the process exit, takes the
replica out of routing at once, restarts it on the same port, and the router re-admits it only with the live
adapters; the survivor's adapter slots are not overfilled by the re-sent completions; the run finishes."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import requests

from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics

from loop_fixtures import MAX_STALENESS, replica_adapters, router_metric
from step_actions import AtStep

STEPS, KILL_AT = 12, 4
OUT_OF_ROUTING_BOUND_S = 5.0  # the supervisor polls every 0.1 s; health checks would take up to 1 s + 5 s timeout
BACK_BOUND_S = 120.0  # a CPU replica's start on 2 busy cores



def server_pid(watchdog_pid: int) -> int:
    """The `cpu_replica` process itself (the watchdog leads its group; the server is its child)."""
    server = psutil.Process(watchdog_pid).children()[0]
    assert "grpo_lab.serving.replicas.cpu_replica" in " ".join(server.cmdline())
    return server.pid


def test_a_local_replica_server_killed_mid_run_is_restarted_and_readmitted(tmp_path, no_leftover_children):
    out = tmp_path / "run"
    args = embedded_trainer_args(str(out), max_staleness=MAX_STALENESS, max_steps=STEPS, save_strategy="no")
    loop = AsyncLoop(LoopConfig(replicas=2), args, progress=False)
    measured: dict = {}
    with loop:
        placement, url = loop.cluster.placement, loop.url
        victim_url, victim_pid = placement.replicas[0].url, placement.replicas[0].pid

        def state_of(u: str) -> str | None:
            try:
                replicas = requests.get(url + "/router/state", timeout=2).json()["replicas"]
            except requests.RequestException:
                return None
            return next((r["state"] for r in replicas if r["url"] == u), None)

        def watch(t0: float):
            while state_of(victim_url) == "in_service" and time.monotonic() - t0 < OUT_OF_ROUTING_BOUND_S * 4:
                time.sleep(0.01)
            measured["out_s"] = time.monotonic() - t0
            while time.monotonic() - t0 < BACK_BOUND_S:
                if placement.replicas[0].pid != victim_pid and state_of(victim_url) == "in_service":
                    measured["back_s"] = time.monotonic() - t0
                    return
                time.sleep(0.05)

        watcher: list[threading.Thread] = []

        def kill_the_server():
            pid = server_pid(victim_pid)
            watcher.append(threading.Thread(target=watch, args=(time.monotonic(),), daemon=True))
            os.kill(pid, signal.SIGKILL)
            watcher[0].start()

        loop.trainer.add_callback(AtStep(KILL_AT, kill_the_server))
        loop.train()
        trainer = loop.trainer
        watcher[0].join(BACK_BOUND_S)

        assert measured["out_s"] < OUT_OF_ROUTING_BOUND_S, measured
        assert "back_s" in measured, (placement.events, measured)
        assert [e[1] for e in placement.events] == ["died", "restarted"]
        assert placement.replicas[0].url == victim_url  # the same port: the router knew it by its URL
        rows = [r for r in read_metrics(out / METRICS_FILE) if "train_runtime" not in r]
        assert trainer.state.global_step == STEPS and [r["step"] for r in rows] == list(range(1, STEPS + 1))
        versions = [p["version"] for p in trainer.published]
        for r in rows:
            assert r["sample/staleness_max"] <= MAX_STALENESS
            if "rollout/version_min" in r:
                assert versions[0] <= r["rollout/version_min"] <= r["rollout/version_max"] <= versions[-1]
        assert router_metric(url, "grpo_router_adapter_loads_total", result="failed") == 0
        live = {f"trl-policy-v{v}" for v in trainer._live_versions}
        for replica in placement.replicas:  # the survivor and the restarted one: exactly the live set, no more
            deadline = time.monotonic() + 30
            while (held := set(replica_adapters(replica.url))) != live:
                assert time.monotonic() < deadline and held > live, (held, live)
                time.sleep(0.2)
        # re-admitted only once it held the live adapters: never asked for one it lacked
        assert router_metric(victim_url, "grpo_replica_unknown_model_total") == 0
    print(f"\n[replica supervision] kill -9 of a CPU replica's server at step {KILL_AT}: out of routing "
          f"{measured['out_s']:.2f} s, restarted and back in service {measured['back_s']:.1f} s after the kill; "
          f"{STEPS} steps done", flush=True)


def test_the_thread_router_of_a_shared_pool_hears_of_a_dead_replica_at_once():
    """The same supervision with the router on a thread (`LocalCluster` with restarts, the shared pool): the launcher
    tells `RouterHandle.replica_died`, the replica comes back on its port and is in service again; with no restarts
    left it stays out of routing."""
    from grpo_lab.serving.clusters.local import LocalCluster
    from grpo_lab.tasks.embedded_model import embedded_model_dir

    cluster = LocalCluster(replicas=2, model=str(embedded_model_dir()), max_staleness=MAX_STALENESS, max_lora_rank=1,
                           replica_args=["--max-model-len", "128", "--torch-threads", "1"],
                           router={"health_interval_s": 5.0}, max_restarts=1).start()
    try:
        placement, router = cluster.placement, cluster.router
        victim = placement.replicas[1]
        state = lambda: {r["url"]: r["state"] for r in router.replicas()}[victim.url]
        for round_ in range(2):  # restarted once, then given up
            pid = server_pid(placement.replicas[1].pid)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while state() == "in_service":
                time.sleep(0.01)
            out_s = time.monotonic() - t0
            assert out_s < OUT_OF_ROUTING_BOUND_S  # not the 5 s health interval + its 5 s timeout
            if round_ == 0:
                deadline = time.monotonic() + BACK_BOUND_S
                while not (placement.replicas[1].pid != victim.pid and state() == "in_service"):
                    assert time.monotonic() < deadline, placement.events
                    time.sleep(0.05)
                print(f"\n[replica supervision, thread router] out of routing {out_s:.2f} s, back in service "
                      f"{time.monotonic() - t0:.1f} s after the kill", flush=True)
        time.sleep(1.0)
        assert [e[1] for e in placement.events] == ["died", "restarted", "died", "given up"]
        assert state() != "in_service" and not placement.replicas[1].alive()
    finally:
        cluster.stop()
    assert not any(r.alive() for r in cluster.replicas)
