"""The Ray tier: a real two-node Ray cluster on this machine, started once for the tier and stopped by PID.

The head node has `{"trainer_node": 1}`, the worker node `{"replica_node": 4}`; replicas ask for `replica_node`, so
a test can prove they landed on the worker node. The cluster is stopped right after the tier's last test (not at the
end of the whole run: later tiers must not share the cores with an idle Ray), and anything of its session still
alive then is an error. The tier skips when Ray is not installed (`pip install 'grpo-lab[ray]'`; the `test` extra
has it). The start and stop times are printed: they are what Ray costs CI.
"""

from __future__ import annotations

import time
import types
from pathlib import Path

import pytest
from two_nodes import HEAD_RESOURCES, WORKER_RESOURCES, TwoNodeCluster

try:
    import ray
except ImportError:  # each test module skips itself (pytest.importorskip) with the reason
    ray = None

HERE = Path(__file__).resolve().parent
_running: dict = {}


def _stop() -> list[str]:
    cluster = _running.pop("cluster", None)
    if cluster is None:
        return []
    t0 = time.monotonic()
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    leftovers = cluster.stop()
    print(f"\n[ray tier] cluster stopped in {time.monotonic() - t0:.1f} s; leftovers: {leftovers}", flush=True)
    return leftovers


@pytest.fixture(scope="session")
def ray_cluster():
    if ray is None:
        pytest.skip("the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
    cluster = _running["cluster"] = TwoNodeCluster()
    t0 = time.monotonic()
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        nodes = cluster.wait_nodes(ray)
    except BaseException:
        _stop()
        raise
    up_s = time.monotonic() - t0
    by_resource = {name: next(n["NodeID"] for n in nodes if name in n["Resources"])
                   for name in (*HEAD_RESOURCES, *WORKER_RESOURCES)}
    print(f"\n[ray tier] two-node cluster up in {up_s:.1f} s at {cluster.address}", flush=True)
    yield types.SimpleNamespace(address=cluster.address, marker=cluster.marker, up_s=up_s,
                                head_node=by_resource["trainer_node"], worker_node=by_resource["replica_node"])
    leftovers = _stop()  # already stopped after the tier's last test, unless the run ended inside the tier
    assert not leftovers, f"processes of the Ray session outlived `ray start`'s stop: {leftovers}"


def pytest_runtest_teardown(item, nextitem):
    """After the tier's last test: stop the cluster now (the session fixture's own teardown comes at the very end)."""
    if "cluster" in _running and (nextitem is None or HERE not in Path(str(nextitem.path)).resolve().parents):
        leftovers = _stop()
        assert not leftovers, f"processes of the Ray session outlived `ray start`'s stop: {leftovers}"
