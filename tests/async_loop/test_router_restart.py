"""The router is not a single point of failure (issue 43, defect 7): `kill -9` of the router process in the middle of
an async-loop run (the embedded CPU default: two CPU replicas, the router, the trainer). The loop's supervisor starts
a new router on the same port, which takes the live adapters and pause state from its state file and re-admits the
replicas from their `/v1/models`; the rollout worker and the control client retry what the dead router had in
flight; the run finishes with every step once, every completion from a version the trainer published, no adapter
left over on a replica, and no process left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import requests

from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.serving.router.process import SupervisedRouter

from loop_fixtures import MAX_STALENESS, replica_adapters, wait_gone
from step_actions import AtStep

STEPS, KILL_AT = 12, 4
RECOVERY_BOUND_S = 60.0  # from the kill to the new router admitting both replicas; measured ~2-5 s on 2 busy cores



def test_a_router_killed_mid_run_is_restarted_on_its_port_and_the_run_finishes(tmp_path, no_leftover_children):
    out = tmp_path / "run"
    args = embedded_trainer_args(str(out), max_staleness=MAX_STALENESS, max_steps=STEPS, save_strategy="no")
    loop = AsyncLoop(LoopConfig(replicas=2), args, progress=False)
    measured: dict = {}
    with loop:
        router = loop.cluster.router
        assert isinstance(router, SupervisedRouter)  # a child process of its own, not a thread of the trainer
        url = loop.url
        first_pid = router.process.router_pid
        replica_pids = [r.pid for r in loop.cluster.replicas]

        def watch_it_come_back(t0: float):
            deadline = t0 + RECOVERY_BOUND_S
            while True:  # back on the same URL, both replicas in service again
                try:
                    states = [r["state"] for r in requests.get(url + "/router/state", timeout=2).json()["replicas"]]
                    if states == ["in_service", "in_service"] and router.process.router_pid != first_pid:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            measured["recovered_s"] = time.monotonic() - t0

        def kill_the_router():  # the trainer goes on at once: its next weight sync meets the dead router
            watcher.append(threading.Thread(target=watch_it_come_back, args=(time.monotonic(),), daemon=True))
            os.kill(router.process.router_pid, signal.SIGKILL)
            watcher[0].start()

        watcher: list[threading.Thread] = []
        loop.trainer.add_callback(AtStep(KILL_AT, kill_the_router))
        loop.train()
        trainer = loop.trainer
        watcher[0].join(RECOVERY_BOUND_S)

        assert "recovered_s" in measured, f"router not back within {RECOVERY_BOUND_S}s: {router.events}"
        assert measured["recovered_s"] < RECOVERY_BOUND_S and [e[1] for e in router.events] == ["died", "restarted"]
        assert router.url == url and router.process.router_pid != first_pid
        assert [r.pid for r in loop.cluster.replicas] == replica_pids  # the replicas were never restarted
        rows = [r for r in read_metrics(out / METRICS_FILE) if "train_runtime" not in r]
        assert trainer.state.global_step == STEPS
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once: none lost, none twice
        versions = [p["version"] for p in trainer.published]
        assert versions == list(range(versions[0], versions[0] + STEPS + 1))  # no name published twice
        for r in rows:  # every completion trained on came from a version this trainer published
            assert r["sample/staleness_max"] <= MAX_STALENESS
            if "rollout/version_min" in r:
                assert versions[0] <= r["rollout/version_min"] <= r["rollout/version_max"] <= versions[-1]
        live = {f"trl-policy-v{v}" for v in trainer._live_versions}
        for replica in loop.cluster.replicas:  # the rebuilt router left nothing stale there (drains end first)
            deadline = time.monotonic() + 30
            while (held := set(replica_adapters(replica.url))) != live:
                assert time.monotonic() < deadline and held > live, (held, live)
                time.sleep(0.2)
        router_pids = [first_pid, router.process.router_pid]
    assert wait_gone(router_pids) == []  # neither router outlived the loop
    print(f"\n[router restart] kill -9 of the router at step {KILL_AT}: back on {url} with both replicas in "
          f"service {measured['recovered_s']:.2f} s later (supervisor: {router.recoveries_s[0]:.2f} s to a new "
          f"router answering); {STEPS} steps done", flush=True)
