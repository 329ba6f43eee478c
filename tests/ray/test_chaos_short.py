"""The chaos run's short version (benchmarks/chaos.py): `grpo-lab async-loop --launcher ray` over the two-host Ray
tier with adapters and checkpoints on the S3 server, a few faults, each in a run of its own. Each run must finish
every step with no rollout lost, none misrouted, nothing stale served and no step logged twice. (How long recovery
took is the benchmark's figure, not asserted: a restarted replica may come back after a short run's last step.)"""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

pytest.importorskip("ray", reason="the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
pytest.importorskip("s3fs", reason="the chaos run keeps adapters on S3: pip install 'grpo-lab[s3]'")
pytestmark = pytest.mark.ray

MAX_STEPS, INJECT_AT, SAVE_STEPS = 8, 3, 3


chaos = load_benchmark("chaos")


def _nodes_hold(marker: str, key: str) -> bool:
    """Whether the Ray nodes' processes carry the S3 credentials (their replicas read the store with them)."""
    for proc in chaos.psutil.process_iter():
        try:
            env = proc.environ()
        except (chaos.psutil.Error, OSError):
            continue
        if env.get(chaos.MARKER) == marker:
            return env.get("AWS_ACCESS_KEY_ID") == key
    return False


@pytest.mark.parametrize("scenario", chaos.SHORT)
def test_the_loop_survives_the_fault_with_nothing_lost(scenario, s3_server, ray_cluster, tmp_path):
    # s3_server first: the nodes must start with the store's credentials in their environment, as on a real cluster
    assert _nodes_hold(ray_cluster.marker, s3_server.key), (
        "the Ray tier's nodes were started before the S3 server, without its credentials: run this module first in "
        "the tier (pytest's file order does) or alone")
    hosts = chaos.Hosts(ray_cluster.network, ray_cluster.address, ray_cluster.marker, s3_server,
                        s3_server.new_bucket(), tmp_path)
    row = chaos.run_scenario(hosts, scenario, MAX_STEPS, INJECT_AT, SAVE_STEPS)
    print(f"\n[chaos] {row}", flush=True)
    assert row["injected_at_step"] != "", row  # the fault was injected
    assert row["run_finished"] and row["steps_done"] == MAX_STEPS, row
    assert (row["stale_served"], row["duplicate_steps"]) == (0, 0), row
    assert (row["rollouts_lost"], row["misrouted"]) == (0, 0), row  # nothing the trainer could use lost or misrouted
