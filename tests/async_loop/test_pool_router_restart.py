"""`grpo-lab serve-pool`'s router is not a single point of failure either (issue 43): `kill -9` of the shared pool's
router while a run trains on it. The pool's supervisor starts a new router on the same port, which takes back the
registered runs (their token digests, shares and pause state), the live adapters and the pause state from its state
file; the run's requests in flight are retried with the same token, and the run finishes every step once, trained
only on versions it published, then leaves with its adapters unloaded everywhere.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.async_loop.serve_pool import PoolConfig, SharedPool
from grpo_lab.serving.adapters.slots import max_loras_for
from grpo_lab.serving.adapters.storage import AdapterStore, version_of
from grpo_lab.serving.router.process import SupervisedRouter

from loop_fixtures import replica_adapters, wait_gone
from test_shared_pool import STALENESS, _join, _steps

STEPS, KILL_AFTER = 6, 2


def test_the_shared_pools_router_killed_mid_run_comes_back_with_its_runs(tmp_path, no_leftover_children):
    config = PoolConfig(replicas=2, state_dir=str(tmp_path / "pool"), adapter_slots=2 * max_loras_for(STALENESS),
                        ready_timeout_s=120)
    with SharedPool(config) as pool:
        router = pool.handle
        assert isinstance(router, SupervisedRouter)  # a child process of its own, restarted by the pool
        url, first_pid = pool.url, router.process.router_pid
        with open(tmp_path / "a.log", "w") as log:
            run = _join(pool.url, pool.admin_key_file, tmp_path / "a", "a", STEPS, log)
            try:
                deadline = time.monotonic() + 300
                while _steps(tmp_path / "a") < KILL_AFTER:
                    assert run.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
                    assert time.monotonic() < deadline, "the run never logged its first steps"
                    time.sleep(0.2)
                assert [r["name"] for r in pool.runs()] == ["a"]
                state_file = Path(router.config.state_file)
                assert stat.S_IMODE(state_file.stat().st_mode) == 0o600  # token digests: its owner's only
                assert "grpo-run-" not in state_file.read_text()  # never a token
                os.kill(first_pid, signal.SIGKILL)
                assert run.wait(timeout=400) == 0, (tmp_path / "a.log").read_text()[-3000:]
            finally:
                if run.poll() is None:
                    os.killpg(run.pid, signal.SIGKILL)
                    run.wait(timeout=10)
        assert [e[1] for e in router.events] == ["died", "restarted"], router.events
        assert pool.url == url and router.process.router_pid != first_pid
        assert pool.runs() == []  # the run left through the new router, with the token the old one gave it
        for replica in pool.cluster.replicas:  # and its adapters went with it
            assert replica_adapters(replica.url) == {}

    text = (tmp_path / "a.log").read_text()
    assert f"async loop done: step {STEPS}/{STEPS}" in text, text[-2000:]
    rows = [r for r in read_metrics(tmp_path / "a" / METRICS_FILE) if "train_runtime" not in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once
    published = [version_of(n, "trl-policy") for n in AdapterStore(tmp_path / "a" / ".vllm_lora").history()]
    for r in rows:  # every completion trained on came from a version this run published, within the window
        assert r["sample/staleness_max"] <= STALENESS
        if "rollout/version_min" in r:
            assert min(published) <= r["rollout/version_min"] <= r["rollout/version_max"] <= max(published)
    assert wait_gone([run.pid], 10) == []
