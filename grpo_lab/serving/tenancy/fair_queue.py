"""Weighted fair sharing of a replica pool's capacity between runs: who sends the next completion.

Without it a shared pool is first come, first served: a run with 384 rollouts in flight fills every replica's queue
and a run with 16 waits behind it on every request. So at most `capacity` completions run at once (the tenancy's
`max_in_flight_per_replica` × replicas in service) and the others wait in one queue per run; when a place frees, the
next completion comes from the backlogged run with the smallest virtual start time (start-time fair queuing):
granting a completion of cost `c` (its `max_tokens`) moves the run's pass to `max(pass, V) + c / weight`, `V` being
the start of the last grant, and an idle run restarts at `V` (it banks no credit). What that guarantees, and how
prefix affinity is kept (the queue decides *when*, the routing policy *where*): docs/shared_pool.md, "Fair sharing".

A run may also pause (TRL pauses "the server" around each adapter sync): its queued completions then stay queued
until it resumes, while its completions already running finish and the other runs go on; a shared replica cannot
be paused for one run. A waiter whose client has gone (a killed trainer) is dropped when its turn comes instead of
being forwarded, or sooner when the lease asks whether its run is still busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


class ClientGone(Exception):
    """The client of a queued completion disconnected before its turn."""


@dataclass
class _Waiter:
    cost: float
    future: asyncio.Future
    gone: Callable[[], bool] | None
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class RunShare:
    """One run's standing in the queue (`FairQueue.shares`)."""

    weight: float = 1.0
    pass_: float = 0.0
    in_flight: int = 0
    granted: int = 0  # completions granted so far
    waited_s: float = 0.0  # total time its completions spent queued
    paused: bool = False
    queue: deque = field(default_factory=deque)


class FairQueue:
    """Completions of several runs under one concurrency `capacity()` (re-read at every grant: replicas come and go).
    One event loop."""

    def __init__(self, capacity: Callable[[], int]):
        self.capacity = capacity
        self.shares: dict[str, RunShare] = {}
        self.in_flight = 0
        self.vtime = 0.0
        self._order = itertools.count()  # ties go to the run granted least recently
        self._last: dict[str, int] = {}

    def share(self, run: str) -> RunShare:
        return self.shares.setdefault(run, RunShare(pass_=self.vtime))

    def set_weight(self, run: str, weight: float) -> None:
        self.share(run).weight = weight

    def set_paused(self, run: str, paused: bool) -> None:
        self.share(run).paused = paused
        if not paused:
            self.kick()

    def forget(self, run: str) -> None:
        """The run is gone: its queued completions fail (ClientGone), its record goes once nothing runs."""
        share = self.shares.get(run)
        if share is None:
            return
        while share.queue:
            waiter = share.queue.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(ClientGone(f"run {run} was removed"))
        if share.in_flight == 0:
            self.shares.pop(run, None)
            self._last.pop(run, None)

    def queued(self, run: str | None = None) -> int:
        """Completions of `run` waiting for a place (None: of every run)."""
        return sum(len(s.queue) for name, s in self.shares.items() if run in (None, name))

    def busy(self, run: str) -> bool:
        """Whether `run` has a completion running, or queued for a client still connected (a paused run's waiters
        are never granted, so a killed trainer's would otherwise keep its run busy, and its lease alive, for ever)."""
        share = self.shares.get(run)
        if share is None:
            return False
        share.queue = deque(w for w in share.queue if not self._dead(w))
        return bool(share.in_flight or share.queue)

    @staticmethod
    def _dead(waiter: _Waiter) -> bool:
        """Whether `waiter` can no longer be granted: its wait was cancelled, or its client disconnected (then its
        wait fails with ClientGone)."""
        if waiter.future.done():
            return True
        if waiter.gone is not None and waiter.gone():
            waiter.future.set_exception(ClientGone("the client disconnected while its completion was queued"))
            return True
        return False

    @contextlib.asynccontextmanager
    async def slot(self, run: str, cost: float = 1.0, gone: Callable[[], bool] | None = None,
                   timeout_s: float | None = None):
        """Hold one of the pool's places for a completion of `run` while the block runs. Waits (fairly) while the
        pool is full or the run is paused, at most `timeout_s` (then TimeoutError); a cancelled wait (client gone,
        deadline) leaves no trace."""
        share = self.share(run)
        cost = max(float(cost), 1.0)
        anyone_waiting = any(s.queue and not s.paused for s in self.shares.values())
        if not share.paused and not anyone_waiting and self.in_flight < self._capacity():
            self._take(run, share, cost, 0.0)
        else:
            future = asyncio.get_running_loop().create_future()
            waiter = _Waiter(cost, future, gone)
            share.queue.append(waiter)
            self.kick()
            try:
                await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except BaseException:
                if not future.done():
                    future.cancel()
                if future.done() and not future.cancelled() and future.exception() is None:
                    self._release(run)  # granted just as the wait was cancelled: give the place back
                else:
                    with contextlib.suppress(ValueError):
                        share.queue.remove(waiter)
                raise
        try:
            yield
        finally:
            self._release(run)

    # -- the rule --------------------------------------------------------------------------------------------------
    def _capacity(self) -> int:
        return max(int(self.capacity()), 1)

    def _take(self, run: str, share: RunShare, cost: float, waited: float) -> None:
        start = max(share.pass_, self.vtime)
        self.vtime = start
        share.pass_ = start + cost / share.weight
        share.in_flight += 1
        share.granted += 1
        share.waited_s += waited
        self.in_flight += 1
        self._last[run] = next(self._order)

    def _release(self, run: str) -> None:
        self.in_flight -= 1
        share = self.shares.get(run)
        if share is not None:
            share.in_flight -= 1
        self.kick()

    def kick(self) -> None:
        """Grant places while there are free ones and completions waiting (call when capacity may have grown)."""
        while self.in_flight < self._capacity():
            ready = [(max(s.pass_, self.vtime), self._last.get(r, -1), r) for r, s in self.shares.items()
                     if s.queue and not s.paused]
            if not ready:
                return
            _, _, run = min(ready)
            share = self.shares[run]
            waiter = share.queue.popleft()
            if self._dead(waiter):
                continue
            self._take(run, share, waiter.cost, time.monotonic() - waiter.queued_at)
            waiter.future.set_result(None)
