"""Replicas joining and leaving a running router (docs/serving.md, "Changes membership while it runs").

A launcher that places replicas on a cluster cannot restart the router each time: TRL's trainer holds its URL, and
the router holds the live adapters and the prefix-affinity table. The HTTP face is `admin_api`; in-process callers
use `RouterHandle`.
"""

from __future__ import annotations

import asyncio
import time

from .replica_pool import ReplicaPool
from .config import replica_url
from ..wire.upstream import IN_SERVICE, REMOVED, Replica, now

POLL_S = 0.05


def describe(replica: Replica, pool: ReplicaPool) -> dict:
    """A replica as /router/state and the admin endpoints report it."""
    return {"url": replica.url, "index": replica.index, "state": replica.state, "adapters": sorted(replica.adapters),
            "draining": sorted(replica.draining), "last_error": replica.last_error,
            "in_flight": pool.policy.in_flight[replica.index]}


class WaitsInService:
    """`wait_ready` for a router handle (in this process or a child) whose `replicas()` lists the members as
    `describe` gives them."""

    def wait_ready(self, replicas: int | None = None, timeout: float = 60.0) -> None:
        """Block until `replicas` (default: every member) replicas are in service; an OSError from `replicas()` (a
        router still starting) is tried again."""
        deadline = time.monotonic() + timeout
        states: list[dict] = []
        while time.monotonic() < deadline:
            try:
                states = self.replicas()
            except OSError:
                states = []
            want = len(states) if replicas is None else replicas
            if states and sum(r["state"] == IN_SERVICE for r in states) >= want:
                return
            time.sleep(POLL_S)
        raise TimeoutError(f"replica(s) not in service after {timeout}s: {states}")


class Membership:
    """Adds and removes replicas of one router's `ReplicaPool` (on its event loop)."""

    def __init__(self, pool: ReplicaPool, metrics):
        self.pool, self.metrics = pool, metrics

    def members(self) -> list[dict]:
        return [describe(r, self.pool) for r in self.pool.replicas]

    async def add(self, url: str, wait_s: float = 0.0) -> dict:
        """Add `url` (ValueError when it is not an http(s) URL); with `wait_s`, wait that long for its admission.
        Returns its description (its `state` says whether it is in service yet)."""
        url = replica_url(url)
        replica = self.pool.member(url)
        if replica is None:
            replica = self.pool.join(url)
            self.metrics.inc("grpo_router_membership_changes_total", "Replicas added to or removed from the router",
                             change="added")
        deadline = now() + wait_s
        while not replica.serving and replica.state != REMOVED and now() < deadline:
            await asyncio.sleep(POLL_S)
        return describe(replica, self.pool)

    async def remove(self, url: str, drain_s: float, reason: str = "removed from the router") -> dict | None:
        """Remove `url` (None when it is not a member). Returns once its completions finished, or were cut and
        re-sent after `drain_s`."""
        replica = self.pool.member(replica_url(url))
        if replica is None:
            return None
        self.pool.leave(replica, reason)
        self.metrics.inc("grpo_router_membership_changes_total", "Replicas added to or removed from the router",
                         change="removed")
        deadline = now() + drain_s
        while replica.tries and now() < deadline:
            await asyncio.sleep(POLL_S)
        cut = replica.tries
        if cut:
            replica.cut_calls()  # their handlers re-send them to the replicas left
        return {**describe(replica, self.pool), "cut": cut}
