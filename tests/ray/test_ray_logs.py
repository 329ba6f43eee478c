"""Issue 43 #11: a Ray replica's output lands where the run says its replicas' logs are (`<output_dir>/logs`), copied
back from the worker node by `ray_logs.LogMirror`, a header per incarnation (a restart by Ray starts a new log)."""

from __future__ import annotations

import time

import pytest

from grpo_lab.serving.clusters.ray_actor import ServerSpec
from grpo_lab.serving.clusters.ray_logs import LogMirror
from grpo_lab.serving.clusters.ray_replicas import RayReplicas

ray = pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytestmark = pytest.mark.ray


def _wait(predicate, timeout: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_ray_replicas_output_is_copied_to_the_runs_log_folder_across_a_restart(ray_cluster, tmp_path):
    logs = tmp_path / "logs"
    with RayReplicas(1, ServerSpec("fake"), resources={"replica_node": 1}) as replicas:
        mirror = LogMirror(replicas, logs, interval_s=0.2).start()
        path = mirror.path(0)
        _wait(lambda: path.is_file() and "READY" in path.read_text(), what="the first server's READY line")
        first = replicas.infos()[0]
        assert f"on node {ray_cluster.worker_ip}" in path.read_text()  # it ran on the worker, this is the head
        ray.kill(replicas.slots[0].actor, no_restart=False)  # Ray restarts it: a new server, a new log
        _wait(lambda: path.read_text().count("--- replica 0, incarnation") == 2, timeout=120,
              what="the restarted server's log")
        mirror.stop()
    text = path.read_text()
    assert text.count("READY") == 2, text
    headers = [line for line in text.splitlines() if line.startswith("--- replica 0, incarnation ")]
    assert headers[0].startswith(f"--- replica 0, incarnation {first['incarnation'][:8]} on node ")
    assert f"(its log there: {first['log']})" in headers[0] and first["log"] not in headers[1]  # each its own file
