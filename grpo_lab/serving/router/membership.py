"""Replicas joining and leaving a running router.

A launcher that places replicas on a cluster (Ray restarting a dead actor on another port or node, an autoscaler
adding one) cannot restart the router each time: TRL's trainer holds its URL, and the router holds the live adapter
set and the prefix-affinity table. So membership changes in place:

- **add**: the replica joins out of routing and is admitted by the same path as a replica that restarted
  (`replica_pool.try_admit`): healthy, consistent with the others' `/server_info`, holding every live adapter
  (loaded by the router, with the storage-lag retry), paused if the others are. Until then no completion goes there,
  so a new replica never answers for an adapter it does not hold. Adding a URL that is already a member changes
  nothing.
- **remove**: the replica takes no new completion at once and the prefix-affinity table forgets what it held (the
  others keep their blocks, so their groups stay where they are). Completions still running there may finish for
  `drain_s` (a replica scaled down on purpose); then they are cut and re-sent to other replicas (a replica that
  died: `drain_s=0`). Its number is reused by a later replica only once nothing of it is in flight.

The HTTP face is `admin_api` (`POST`/`DELETE /router/replicas`, behind the admin key); in-process callers (the async
loop, `ray_replicas`) use `RouterHandle.add_replica` / `remove_replica`, which call this.
"""

from __future__ import annotations

import asyncio

from .replica_pool import ReplicaPool
from .config import replica_url
from ..wire.upstream import REMOVED, Replica, now

POLL_S = 0.05


def describe(replica: Replica, pool: ReplicaPool) -> dict:
    """A replica as /router/state and the admin endpoints report it."""
    return {"url": replica.url, "index": replica.index, "state": replica.state, "adapters": sorted(replica.adapters),
            "draining": sorted(replica.draining), "last_error": replica.last_error,
            "in_flight": pool.policy.in_flight[replica.index]}


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
