"""The router inside this process, on its own event loop in a daemon thread, for notebooks, tests and the async loop.

    handle = start_router(RouterConfig(replicas=[...], port=0))   # port 0: a free port
    handle.wait_ready()                                             # every replica in service
    ... handle.url ...
    handle.add_replica("http://10.0.0.7:8001", wait_s=60)          # membership changes while it runs
    handle.remove_replica("http://10.0.0.5:8001", drain_s=0)
    run = handle.register_run("sweep-a", max_staleness=4)          # with RouterConfig(tenancy=...): run["token"]
    handle.remove_run("sweep-a")
    handle.stop()
"""

from __future__ import annotations

import asyncio

from ..adapters.slots import DEFAULT_MAX_STALENESS
from .server import Router
from .config import RouterConfig
from .membership import WaitsInService
from ..wire.app_thread import AppThread


class RouterHandle(AppThread, WaitsInService):
    """A router running on its own event loop in a daemon thread (notebooks, tests)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.router = Router(config)
        super().__init__(self.router.app, config.host, config.port, "grpo-router", "router")

    def call(self, fn, timeout: float = 30.0):
        """Run `fn()` (sync) on the router's loop, e.g. to inspect state consistently."""
        async def wrapped():
            return fn()
        return self._run_on_loop(wrapped(), timeout)

    def _run_on_loop(self, coroutine, timeout: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def add_replica(self, url: str, wait_s: float = 0.0) -> dict:
        """Add a replica while the router runs; it is routed to only once it holds every live adapter. With `wait_s`,
        wait that long for its admission. Returns its description (`state` is "in_service" once admitted)."""
        return self._run_on_loop(self.router.membership.add(url, wait_s), wait_s + 30)

    def remove_replica(self, url: str, drain_s: float | None = None) -> dict | None:
        """Remove a replica; its completions may finish for `drain_s` (default `remove_drain_timeout_s`; 0 for a
        replica that died), then they are re-sent elsewhere. None when `url` is not a member."""
        drain_s = self.config.remove_drain_timeout_s if drain_s is None else drain_s
        return self._run_on_loop(self.router.membership.remove(url, drain_s), drain_s + 30)

    def replica_died(self, url: str, why: str) -> bool:
        """A launcher saw the replica's server exit: out of routing now (its completions in flight are re-sent), not
        after health checks time out; the health watch re-admits it, with the live adapters, once it serves again.
        False when `url` is not a member."""
        def down() -> bool:
            replica = self.router.pool.member(url)
            if replica is not None:
                self.router.pool.mark_down(replica, why)
            return replica is not None
        return self.call(down)

    def replicas(self) -> list[dict]:
        """The current members with their states."""
        return self.call(self.router.membership.members)

    # -- runs sharing the replicas (RouterConfig.tenancy) --------------------------------------------------------
    def _tenancy(self):
        if self.router.tenancy is None:
            raise RuntimeError("this router shares nothing: start it with RouterConfig(tenancy=TenancyConfig(...))")
        return self.router.tenancy

    def register_run(self, name: str, max_staleness: int = DEFAULT_MAX_STALENESS, weight: float = 1.0,
                     replace: bool = False) -> dict:
        """Register a training run (what `POST /router/runs` does): its description, with its `token` (the only
        time it is shown; hand it to the run, e.g. in its environment). `tenancy.TenancyError` says why not."""
        tenancy = self._tenancy()
        return self.call(lambda: tenancy.add_run(name, max_staleness, weight, replace))

    def remove_run(self, name: str) -> list[str] | None:
        """Remove a run and unload its adapters (after their drain); None when there is no such run."""
        tenancy = self._tenancy()
        run = self.call(lambda: tenancy.registry.runs.get(name))
        if run is None:
            return None
        return self._run_on_loop(tenancy.remove(run, "admin", "removed through the Python API"), 60)

    def runs(self) -> list[dict]:
        """The registered runs (never their tokens)."""
        tenancy = self._tenancy()
        return self.call(lambda: [tenancy.describe(r) for r in tenancy.registry.runs.values()])

def start_router(config: RouterConfig) -> RouterHandle:
    """Start a router in this process and return its handle (`.url`, `.wait_ready()`, `.stop()`)."""
    return RouterHandle(config).start()
