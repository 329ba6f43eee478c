"""The Ray tier: a real two-node Ray cluster on this machine, started once for the tier and stopped by PID.

The head node has `{"trainer_node": 1}`, the worker node `{"replica_node": 4}`; replicas ask for `replica_node`, so
a test can prove they landed on the worker node. Each node is a host of its own: a network namespace with its own
address on the run's network (`netns`), so head and worker talk across the worker's link, which a test can cut
(`ray_cluster.network.partition("worker")`). The driver is on the head node, as on a real cluster: this process's
main thread enters the head's namespace for the tier (`ray.init`, the trainer, the router and every process a test
starts live there) and leaves it when the cluster stops. The cluster is stopped right after the tier's last test
(not at the end of the whole run: later tiers must not share the cores with an idle Ray), and anything of its session
still alive then is an error. The tier skips when Ray is not installed (`pip install 'grpo-lab[ray]'`; the `test`
extra has it) or namespaces cannot be made (not root, no `ip`); CI sets GRPO_LAB_REQUIRE_NETNS=1, which turns the
latter into a failure. The start and stop times are printed: they are what Ray costs CI.
"""

from __future__ import annotations

import contextlib
import time
import types
from pathlib import Path

import netns
import pytest
from two_nodes import HEAD, HEAD_RESOURCES, WORKER_RESOURCES, TwoNodeCluster

try:
    import ray
except ImportError:  # each test module skips itself (pytest.importorskip) with the reason
    ray = None

HERE = Path(__file__).resolve().parent
_running: dict = {}


def _restart_fsspec_io() -> None:
    """fsspec makes every S3 call on one IO thread per process. One that started while this thread was on the head
    (the tier's S3 calls) stays in the head's namespace, which is gone once the cluster stops, and later tiers would
    find the store unreachable (ENETUNREACH). So its loop is stopped and forgotten, with the cached clients bound to
    it: the next call starts a new one in the namespace the tests are in now."""
    import fsspec.asyn
    from s3_fixtures import forget_s3_clients

    loop = fsspec.asyn.loop[0]
    if loop is not None:
        loop.call_soon_threadsafe(loop.stop)
    fsspec.asyn.reset_lock()
    forget_s3_clients()


def _stop() -> list[str]:
    cluster = _running.pop("cluster", None)
    if cluster is None:
        return []
    t0 = time.monotonic()
    try:
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    finally:
        if "home" in _running:  # back to the namespace this thread came from
            cluster.network.leave(_running.pop("home"))
            _restart_fsspec_io()
        leftovers = cluster.stop()
        _running.pop("network").close()
    print(f"\n[ray tier] cluster stopped in {time.monotonic() - t0:.1f} s; leftovers: {leftovers}", flush=True)
    return leftovers


@pytest.fixture(scope="session")
def ray_cluster():
    if ray is None:
        pytest.skip("the Ray tier needs Ray: pip install 'grpo-lab[ray]'")
    netns.require_or_skip("the Ray tier (head and worker on hosts of their own)")
    t0 = time.monotonic()
    network = contextlib.ExitStack()
    cluster = TwoNodeCluster(network.enter_context(netns.shared_network()))
    _running["network"], _running["cluster"] = network, cluster
    try:
        cluster.start()
        _running["home"] = cluster.network.enter(HEAD)
        ray.init(address=cluster.address, _node_ip_address=cluster.head_ip, log_to_driver=False,
                 configure_logging=False)
        nodes = cluster.wait_nodes(ray)
    except BaseException:
        _stop()
        raise
    up_s = time.monotonic() - t0
    by_resource = {name: next(n["NodeID"] for n in nodes if name in n["Resources"])
                   for name in (*HEAD_RESOURCES, *WORKER_RESOURCES)}
    print(f"\n[ray tier] two-node cluster up in {up_s:.1f} s at {cluster.address} (worker {cluster.worker_ip})",
          flush=True)
    yield types.SimpleNamespace(address=cluster.address, marker=cluster.marker, up_s=up_s, network=cluster.network,
                                head_ip=cluster.head_ip, worker_ip=cluster.worker_ip,
                                head_node=by_resource["trainer_node"], worker_node=by_resource["replica_node"])
    leftovers = _stop()  # already stopped after the tier's last test, unless the run ended inside the tier
    assert not leftovers, f"processes of the Ray session outlived `ray start`'s stop: {leftovers}"


def pytest_runtest_teardown(item, nextitem):
    """After the tier's last test: stop the cluster now (the session fixture's own teardown comes at the very end)."""
    if "cluster" in _running and (nextitem is None or HERE not in Path(str(nextitem.path)).resolve().parents):
        leftovers = _stop()
        assert not leftovers, f"processes of the Ray session outlived `ray start`'s stop: {leftovers}"
