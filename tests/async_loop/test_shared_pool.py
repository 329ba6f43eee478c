"""Three `grpo-lab async-loop` runs at once on one shared pool (`grpo-lab serve-pool`'s `SharedPool`: 2 CPU replicas
and a tenancy router), one of them killed with kill -9.

What a lab sharing a pool needs to be true: every completion a run trained on came from a version that run
published; no run's adapter was ever unloaded by anyone but that run (or, once it is dead, by its lease); the killed
run's adapters are reclaimed after its lease while the other two finish, each with its own figures and the doctor's
verdict; nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.async_loop.serve_pool import PoolConfig, SharedPool
from grpo_lab.serving.adapters.slots import max_loras_for
from grpo_lab.serving.adapters.storage import AdapterStore, version_of

from loop_fixtures import descendants, replica_adapters, wait_gone

STALENESS = 2
LEASE_S = 8.0


def _steps(out: Path) -> int:
    path = out / METRICS_FILE
    return len([r for r in read_metrics(path) if "train_runtime" not in r]) if path.exists() else 0


def _join(url: str, key_file: str, out: Path, name: str, steps: int, log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("GRPO_LAB_RUN_TOKEN", None)
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_lab.cli", "async-loop", "--router-url", url, "--run-name", name,
         "--pool-admin-key-file", key_file, "--output-dir", str(out), "--max-steps", str(steps), "--save-steps",
         "1000", "--max-staleness", str(STALENESS), "--prompts-per-step", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def test_three_runs_share_two_replicas_and_a_killed_one_is_reclaimed(tmp_path, no_leftover_children):
    config = PoolConfig(replicas=2, state_dir=str(tmp_path / "pool"), lease_s=LEASE_S,
                        adapter_slots=3 * max_loras_for(STALENESS), ready_timeout_s=120)
    procs: dict[str, subprocess.Popen] = {}
    with SharedPool(config) as pool:
        admin = {"Authorization": f"Bearer {Path(pool.admin_key_file).read_text().strip()}"}
        logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("a", "b", "victim")}
        try:
            for name, steps in (("a", 3), ("b", 3), ("victim", 200)):
                procs[name] = _join(pool.url, pool.admin_key_file, tmp_path / name, name, steps, logs[name])
            victim = procs["victim"]
            deadline = time.monotonic() + 300
            while _steps(tmp_path / "victim") < 1:
                assert victim.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the victim never logged a step"
                time.sleep(0.5)
            children = descendants(victim.pid)
            assert any(n.startswith("victim--") for n in replica_adapters(pool.cluster.replicas[0].url))
            os.kill(victim.pid, signal.SIGKILL)  # no goodbye: only the lease can free its adapters
            killed_at = time.monotonic()
            victim.wait(timeout=10)
            assert wait_gone(children, 20) == [], "the killed run's rollout worker outlived it"

            for name in ("a", "b"):
                assert procs[name].wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
            # reclaimed after its lease, not before, and without anyone else's help (its rollouts, running or
            # queued behind a pause for its adapter sync, were cancelled with their connections)
            deadline = max(time.monotonic(), killed_at + LEASE_S) + 30
            while "victim" in {r["name"] for r in pool.runs()} and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "victim" not in {r["name"] for r in pool.runs()}
            # its adapters leave each replica after their drain, a moment after the removal
            while any(replica_adapters(r.url) for r in pool.cluster.replicas) and time.monotonic() < deadline + 30:
                time.sleep(0.2)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            for log in logs.values():
                log.close()

        state = requests.get(pool.url + "/router/state", headers=admin, timeout=10).json()
        for replica in pool.cluster.replicas:  # every run left or was reclaimed: nothing of theirs is held
            assert replica_adapters(replica.url) == {}
        unloads = state["unloads"]
        assert unloads
        for u in unloads:  # each adapter unloaded by its own run, or for the dead one by its lease
            assert u["adapter"].startswith(u["run"] + "--"), u
            assert u["by"] == ("lease" if u["run"] == "victim" else "run"), u
        assert any(u["run"] == "victim" and u["by"] == "lease" for u in unloads)
        metrics = requests.get(pool.url + "/metrics", headers=admin, timeout=10).text
        for name in ("a", "b", "victim"):  # the router's figures are labelled by run
            assert f'grpo_router_run_completions_total{{run="{name}",status="200"}}' in metrics

    for name in ("a", "b"):
        out = tmp_path / name
        text = (tmp_path / f"{name}.log").read_text()
        assert "async loop done: step 3/3" in text and "\ndoctor: " in text, text[-2000:]
        assert f"run {name} on a shared pool" in text
        published = [version_of(n, "trl-policy") for n in AdapterStore(out / ".vllm_lora").history()]
        rows = [r for r in read_metrics(out / METRICS_FILE) if "train_runtime" not in r]
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:  # every completion trained on came from a version this run published
            assert r["sample/staleness_max"] <= STALENESS
            if "rollout/version_min" in r:
                assert min(published) <= r["rollout/version_min"] <= r["rollout/version_max"] <= max(published)
            assert 0.9 <= r["ratio"] <= 1.1, r["ratio"]  # its own adapter scored it, not a neighbour's
            routed = r["router"]["routing"]  # its board's figures are its own completions
            assert sum(routed.values()) > 0
        record = json.loads((out / "run.json").read_text())
        assert record["command"][:2] == ["grpo-lab", "async-loop"]
    all_procs = [p.pid for p in procs.values()]
    assert wait_gone(all_procs, 10) == []
