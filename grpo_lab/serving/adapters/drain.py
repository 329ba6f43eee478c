"""Unloading an adapter without cutting the completions that still use it.

TRL unloads `v{N-S-1}` right after loading `vN`, while its rollouts may still be generating; a plain fan-out unload
would fail them. So the router answers the unload at once and routes no *new* completion to the name, and each
replica unloads it once its own completions for it have finished (or after `unload_drain_timeout_s`), the adapter
keeping its slot meanwhile (docs/serving.md, "Drains unloads").
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from .fanout import unload_one
from ..wire.upstream import Replica, now

log = logging.getLogger(__name__)


async def set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event`, at most `timeout_s`; whether it was set by then."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False


class AdapterUsage:
    """Completions in flight per (replica, adapter), so a drain knows when a replica is done with an adapter."""

    def __init__(self):
        self._counts: Counter[tuple[int, str]] = Counter()
        self._idle: dict[tuple[int, str], asyncio.Event] = {}

    def begin(self, replica: int, model: str) -> None:
        self._counts[replica, model] += 1

    def end(self, replica: int, model: str) -> None:
        key = (replica, model)
        self._counts[key] -= 1
        if self._counts[key] <= 0:
            del self._counts[key]
            if (event := self._idle.pop(key, None)) is not None:
                event.set()

    def in_flight(self, replica: int, model: str) -> int:
        return self._counts[replica, model]

    async def wait_idle(self, replica: int, model: str, timeout_s: float) -> bool:
        """True once no completion for `model` is in flight on `replica`; False if `timeout_s` passed first."""
        key = (replica, model)
        if key not in self._counts:
            return True
        return await set_within(self._idle.setdefault(key, asyncio.Event()), timeout_s)


class Drainer:
    """Runs the per-replica drains of unloaded adapters for a `ReplicaPool`."""

    def __init__(self, pool):
        self.pool = pool
        self.usage = AdapterUsage()
        self._tasks: set[asyncio.Task] = set()
        self._since: dict[tuple[int, str], float] = {}  # (replica number, adapter) -> when its drain began

    def draining(self) -> dict[str, dict[str, int]]:
        """{adapter: {replica url: completions still in flight}} for the adapters being drained."""
        out: dict[str, dict[str, int]] = {}
        for r in self.pool.replicas:
            for name in sorted(r.draining):
                out.setdefault(name, {})[r.url] = self.usage.in_flight(r.index, name)
        return out

    def start(self, name: str, replicas: list[Replica]) -> None:
        """Stop new completions for `name` on `replicas` now; unload it on each once drained (in the background)."""
        for replica in replicas:
            replica.draining.add(name)
            self._since[(replica.index, name)] = now()
            task = asyncio.get_running_loop().create_task(self._drain(replica, name))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def is_draining(self, name: str) -> bool:
        return any(name in r.draining for r in self.pool.replicas)

    async def wait_done(self, name: str, timeout_s: float) -> bool:
        """Wait until no replica drains `name` any more (a load of the same name must not race its unload);
        every drain that ends frees a slot, so the pool's `slot_freed` says when to look again."""
        deadline = now() + timeout_s
        while self.is_draining(name):
            left = deadline - now()
            if left <= 0:
                return False
            await set_within(self.pool.slot_freed, left)
        return True

    async def wait_for_slots(self, replicas: list[Replica], timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until each replica that is at its `max_loras` because of adapters still
        draining has a free slot (a replica full of live adapters is not waited for: the load goes ahead and the
        replica answers for itself). Nor is a paused pool: its draining completions are frozen until the resume,
        which TRL sends only after this load (so the replica briefly holds one adapter more: vLLM takes it, evicting
        its least recently used one from its cache; give CPU replicas `--max-loras max_staleness + 3`)."""
        deadline = now() + timeout_s
        while not self.pool.paused:
            waiting = [r for r in replicas
                       if r.draining and r.max_loras is not None and r.slots_used() >= r.max_loras]
            left = deadline - now()
            if not waiting or left <= 0:
                return
            await set_within(self.pool.slot_freed, left)

    async def make_room(self, replicas: list[Replica]) -> None:
        """End drains early where a replica refused a load for lack of slots: on each of `replicas` still at its
        `max_loras`, unload its longest-draining adapter now, cutting the completions that still use it. A drain can
        outlast a sync when the replicas are paused (its completions are frozen) or when a replica died and the
        survivors queue its re-sent completions behind their own; the version it drains is then more than
        `max_staleness` behind the one being loaded, so what those completions would bring is dropped as too stale
        anyway, while the overfilled replica would refuse the load (the CPU replica) or evict a live adapter
        (vLLM)."""
        for replica in replicas:
            while replica.max_loras is not None and replica.slots_used() >= replica.max_loras and replica.draining:
                name = min(replica.draining, key=lambda n: self._since.get((replica.index, n), 0.0))
                replica.draining.discard(name)  # its drain task sees it gone and stops
                outcome = await unload_one(self.pool.client, replica, name, self.pool.config.control_timeout_s)
                self.pool.metrics.inc("grpo_router_drains_cut_total", "Drains ended early to free a slot a load "
                                      "needed", replica=replica.url)
                log.warning("adapter %s unloaded from %s before its %d completion(s) finished: a load needs the slot",
                            name, replica.url, self.usage.in_flight(replica.index, name))
                if not outcome.ok:  # it may still hold it: out of routing, re-admission unloads it
                    self.pool.mark_down(replica, f"unload of draining adapter {name} failed: {outcome.status} "
                                                 f"{outcome.message}")
                    break
            self.pool.notify_slot_freed()

    async def _drain(self, replica: Replica, name: str) -> None:
        pool, config = self.pool, self.pool.config
        began = now()
        try:
            drained = await self.usage.wait_idle(replica.index, name, config.unload_drain_timeout_s)
            if not drained:
                pool.metrics.inc("grpo_router_drain_timeouts_total",
                                 "Unloads sent while completions still used the adapter (drain deadline passed)",
                                 replica=replica.url)
                log.warning("adapter %s still had %d completion(s) on %s after %gs; unloading anyway", name,
                            self.usage.in_flight(replica.index, name), replica.url, config.unload_drain_timeout_s)
            if name not in replica.draining or not replica.serving:
                return  # it went down meanwhile: re-admission unloads whatever is not live
            outcome = await unload_one(pool.client, replica, name, config.control_timeout_s)
            if not outcome.ok:  # it may still hold the adapter: re-admission unloads it, so the slot is not lost
                pool.mark_down(replica, f"unload of drained adapter {name} failed: {outcome.status} {outcome.message}")
            pool.metrics.observe("grpo_router_drain_seconds", "Time from unload request to upstream unload",
                                 now() - began, (0.01, 0.1, 1, 5, 30, 120, 600))
        finally:
            replica.draining.discard(name)
            self._since.pop((replica.index, name), None)
            pool.notify_slot_freed()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
