"""The two rollout-worker knobs the trainer may turn while the run goes on: requests in flight and the queue bound.

TRL 1.16's rollout worker fixes both when its child starts (its slots and its `multiprocessing.Queue` bound), so
`LiveKnobs` holds the two values in shared memory handed to the spawned child, which reads them at every admission
(`LiveLimiter`) and every put (`BoundedBuffer`); TRL's slots and queue are sized for the upper bounds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing as mp
import queue
from multiprocessing.context import get_spawning_popen


class _SharedKnob:
    """A knob of `LiveKnobs`: its value lives in shared memory (`_<name>`), and a new one is clamped to 1..`bound`
    (the name of the instance's upper bound)."""

    def __init__(self, bound: str):
        self.bound = bound

    def __set_name__(self, owner, name: str) -> None:
        self.shared = f"_{name}"

    def __get__(self, knobs, owner=None):
        return self if knobs is None else int(getattr(knobs, self.shared).value)

    def __set__(self, knobs, value: int) -> None:
        getattr(knobs, self.shared).value = int(min(max(value, 1), getattr(knobs, self.bound)))


class LiveKnobs:
    """Requests in flight and the rollout queue's bound now, shared between the trainer and its rollout worker's
    child, within `max_inflight` and `max_queue` (what TRL's slots and queue are sized for)."""

    inflight = _SharedKnob("max_inflight")
    queue_bound = _SharedKnob("max_queue")

    def __init__(self, inflight: int, queue_bound: int, max_inflight: int, max_queue: int):
        if not 1 <= inflight <= max_inflight or not 1 <= queue_bound <= max_queue:
            raise ValueError(f"live knobs out of their bounds: in flight {inflight} of 1..{max_inflight}, queue "
                             f"{queue_bound} of 1..{max_queue}")
        ctx = mp.get_context("spawn")
        self._inflight = ctx.RawValue("i", inflight)
        self._queue_bound = ctx.RawValue("i", queue_bound)
        self.max_inflight, self.max_queue = max_inflight, max_queue

    def __reduce__(self):
        if get_spawning_popen() is None:
            # TRL pickles the worker's arguments once to check they can be pickled: a copy of the values will do
            return (LiveKnobs, (self.inflight, self.queue_bound, self.max_inflight, self.max_queue))
        return (_attached, (self._inflight, self._queue_bound, self.max_inflight, self.max_queue))


def _attached(inflight_value, queue_value, max_inflight: int, max_queue: int) -> LiveKnobs:
    knobs = object.__new__(LiveKnobs)
    knobs._inflight, knobs._queue_bound = inflight_value, queue_value
    knobs.max_inflight, knobs.max_queue = max_inflight, max_queue
    return knobs


class LiveLimiter:
    """First-come, first-served admission of rollout requests under `knobs.inflight`, read at every admission.

    A raised cap admits waiters at the next release or the next `tick` (every `tick_s`); a lowered one lets the
    requests already sent finish and admits no more until fewer than the cap are left. `gate` (optional) must also
    be true for an admission: the rollout worker passes "the rollout queue holds fewer than `knobs.queue_bound`", so
    no request starts while the trainer is behind (TRL's score queue would otherwise keep up to 16 finished groups
    aging outside both knobs)."""

    def __init__(self, knobs: LiveKnobs, tick_s: float = 0.05, gate=None):
        self.knobs, self.tick_s, self.gate = knobs, tick_s, gate
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if not self._waiters and self._open():
            self.active += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # admitted just as it was cancelled: give the place back
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.active -= 1
        self.admit()

    def admit(self) -> None:
        while self._waiters and self._open():
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self.active += 1

    def _open(self) -> bool:
        return self.active < self.knobs.inflight and (self.gate is None or self.gate())

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def tick(self) -> None:
        """Admit waiters when the trainer raised the cap while nothing was released (run as a task)."""
        while True:
            await asyncio.sleep(self.tick_s)
            self.admit()


class BoundedBuffer:
    """The rollout queue as TRL's score loop sees it: `put_nowait` raises `queue.Full` (TRL then waits and counts
    `rollout/backpressure_s`) while the queue holds `knobs.queue_bound` samples or more; everything else passes
    through to the `multiprocessing.Queue`."""

    def __init__(self, buffer, knobs: LiveKnobs):
        self._buffer, self._knobs = buffer, knobs

    def put_nowait(self, item) -> None:
        if self._buffer.qsize() >= self._knobs.queue_bound:
            raise queue.Full
        self._buffer.put_nowait(item)

    def __getattr__(self, name):
        return getattr(self._buffer, name)
