"""TRL's rollout worker, made to run without vLLM installed and to end cleanly on every fault.

`LabRolloutWorker` keeps TRL 1.16's loop and changes what docs/async_loop.md measures ("The trainer"):

- no `vllm` import check (the child only uses aiohttp);
- **group-consistent versions**: a group's rollouts, and its samples' stamps, name its first rollout's version;
- a group out of the staleness window, or answered "no such adapter", is abandoned instead of retried (a
  version still inside the window counts as lost: `rollout/stale_adapter_total`);
- failing requests are retried for at most `rollout_failure_timeout_s`; a 4xx other than a stale adapter fails
  at once;
- a run on a shared pool sends its token (`pool.run_headers`, inherited through the environment);
- the child exits with the trainer (parent-death signal plus a watchdog); `check_health` notices it at once;
- with `live_knobs` (autotune, docs/async_loop.md "Autotune"), TRL draws up to the knobs' upper bounds and only
  `live_knobs.inflight` rollouts send a request at a time (FIFO, a group's version pinned at its first
  admission); a sample is queued, and a request admitted, only while the queue and the groups waiting to be
  scored hold fewer than `live_knobs.queue_bound`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import signal
import threading
import time
from unittest import mock

import aiohttp
from trl.experimental.async_grpo import async_rollout_worker as trl_worker
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

from ..serving.adapters.slots import DEFAULT_MAX_STALENESS
from .live_knobs import BoundedBuffer, LiveKnobs, LiveLimiter
from .loop_settings import LoopSettings
from .pool import run_headers

_PINNED_VERSION: contextvars.ContextVar = contextvars.ContextVar("grpo_lab_pinned_version", default=None)
_RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError)


class StaleAdapter(Exception):
    """The server no longer serves the adapter a rollout names: its group is abandoned."""


class RolloutServerError(RuntimeError):
    """Rollouts cannot be generated: the server kept failing, or refused a request no retry can fix."""


class _RetryableStatus(aiohttp.ClientError):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the trainer process dies, even by SIGKILL (no `finally` runs there to stop us)."""
    with contextlib.suppress(OSError):  # not Linux: the watchdog below still does it
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    if os.getppid() != parent_pid:
        os._exit(3)
    threading.Thread(target=watch, name="grpo-lab-parent-watchdog", daemon=True).start()


class LabRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the spawned child) with pinned group versions, bounded retries and no orphans."""

    def __init__(self, *, max_staleness: int = DEFAULT_MAX_STALENESS, group_consistent_versions: bool = True,
                 rollout_failure_timeout_s: float = LoopSettings.rollout_failure_timeout, parent_pid: int | None = None,
                 live_knobs: LiveKnobs | None = None, **kwargs):
        if parent_pid is not None:
            _die_with_parent(parent_pid)
        super().__init__(**kwargs)
        self._headers = run_headers()  # this child's environment is fixed at spawn: read the run's token once
        self._limiter = None
        if live_knobs is not None:
            self.rollout_buffer = BoundedBuffer(self.rollout_buffer, live_knobs)
            self._limiter = LiveLimiter(live_knobs, gate=self._queue_has_room)
            self._live_knobs = live_knobs
        self.max_staleness = max_staleness
        self.group_consistent_versions = group_consistent_versions
        self.rollout_failure_timeout_s = rollout_failure_timeout_s
        self._group_versions: dict[int, int] = {}
        self._abandoned: set[int] = set()

    def _queue_has_room(self) -> bool:
        """Admission gate under live knobs: the samples made and not yet taken by the trainer, those in the rollout
        queue and those of finished groups waiting to be scored (TRL holds up to 16 groups there while the queue is
        full, all made with the version of their time), are fewer than the queue bound."""
        waiting = self._groups_to_score.qsize() * self.num_generations
        return self.rollout_buffer.qsize() + waiting < self._live_knobs.queue_bound

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            super().run()
        finally:
            # unconsumed samples must not keep this process alive at exit (a full pipe blocks the queue's feeder)
            for q in (self.rollout_buffer, self._metrics_queue):
                q.cancel_join_thread()

    async def _run_loops(self, stop_event: asyncio.Event) -> None:
        """TRL's loops, but a stop request cancels the requests in flight after a short grace period: TRL waits
        for every one of them (tens of seconds on a busy replica, then it is terminated)."""
        loops = asyncio.ensure_future(super()._run_loops(stop_event))
        stop = asyncio.ensure_future(stop_event.wait())
        ticker = asyncio.ensure_future(self._limiter.tick()) if self._limiter is not None else None
        await asyncio.wait({loops, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not loops.done():
            try:
                await asyncio.wait_for(asyncio.shield(loops), timeout=2.0)
            except asyncio.TimeoutError:
                loops.cancel()
        stop.cancel()
        if ticker is not None:
            ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loops

    # -- versions -----------------------------------------------------------------------------------------------
    def _repeat_iterator(self):
        for group_id, row in super()._repeat_iterator():
            if self._limiter is None:  # with a live cap, a group's version is pinned when its first rollout is admitted
                self._group_versions.setdefault(group_id, self.model_version)
            yield group_id, row

    @property
    def _request_model(self) -> str:
        if self.lora_name is None:
            return self.model_name
        pinned = _PINNED_VERSION.get()
        return f"{self.lora_name}-v{self.model_version if pinned is None else pinned}"

    def _is_stale(self, version: int) -> bool:
        return self.model_version - version > self.max_staleness

    async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        if self._limiter is None:
            return await self._generate_pinned(prompt, tool_dict, tools, group_id)
        await self._limiter.acquire()
        try:
            self._group_versions.setdefault(group_id, self.model_version)
            return await self._generate_pinned(prompt, tool_dict, tools, group_id)
        finally:
            self._limiter.release()

    async def _generate_pinned(self, prompt, tool_dict, tools, group_id: int):
        version = self._group_versions.get(group_id, self.model_version)
        if self.group_consistent_versions:
            _PINNED_VERSION.set(version)
        if group_id in self._abandoned or self._is_stale(version):
            self._abandoned.add(group_id)
            return [], [], [], 0, 0, None
        try:
            return await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)
        except StaleAdapter:
            self._abandoned.add(group_id)
            if not self._is_stale(version):  # the trainer could still have used it: a rollout lost
                self._counters["rollout/stale_adapter_total"] += 1
            return [], [], [], 0, 0, None

    async def _score_group(self, group):
        version = self._group_versions.pop(group.group_id, group.model_version)
        if group.group_id in self._abandoned:
            self._abandoned.discard(group.group_id)
            self._push_metrics({"rollout/abandoned_groups_total": 1.0})
            return []
        group.model_version = version
        samples = await super()._score_group(group)
        values = {"rollout/version_min": float(version), "rollout/version_max": float(version)}
        if self._limiter is not None:  # TRL's rollout/inflight counts the drawn rollouts waiting for admission too
            values["rollout/requests_inflight"] = float(self._limiter.active)
        self._push_metrics(values)
        return samples

    # -- requests -----------------------------------------------------------------------------------------------
    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        async with self.session.post(f"{self.vllm_server_url}{path}", json=payload, timeout=client_timeout,
                                     headers=self._headers) as resp:
            if resp.status == 200:
                content = await resp.json(content_type=None)
                if not isinstance(content, dict) or not content.get("choices"):
                    raise _RetryableStatus(200, f"malformed answer without choices: {str(content)[:200]}")
                return content
            text = await resp.text()
        model = payload.get("model")
        if resp.status == 404 and self.lora_name and isinstance(model, str) and model.startswith(self.lora_name):
            version = model.rsplit("-v", 1)[-1]
            if version.isdigit() and int(version) < self.model_version:
                raise StaleAdapter(model)  # unloaded after a newer version went live: nothing to retry
        if resp.status >= 500 or resp.status in (404, 408, 429):
            raise _RetryableStatus(resp.status, text)
        raise RolloutServerError(f"{self.vllm_server_url}{path} refused a rollout request with {resp.status}: "
                                 f"{text[:500]}")

    async def _retry(self, coro_factory, *, label: str, max_attempts: int = 1):
        """Retry transport errors and 5xx answers with back-off, for at most `rollout_failure_timeout_s`."""
        give_up = time.monotonic() + self.rollout_failure_timeout_s
        attempt = 0
        while True:
            try:
                return await coro_factory()
            except _RETRYABLE as error:
                attempt += 1
                if time.monotonic() >= give_up:
                    raise RolloutServerError(
                        f"{label} to {self.vllm_server_url} kept failing for {self.rollout_failure_timeout_s:.0f}s "
                        f"({attempt} attempts); last error: {type(error).__name__}: {error}. "
                        + _failure_hint(error)) from error
                self._counters["rollout/vllm_retry_total"] += 1
                await asyncio.sleep(min(0.25 * 2 ** min(attempt, 5), 5.0, max(give_up - time.monotonic(), 0.05)))


def _failure_hint(error: BaseException) -> str:
    """Where to look next: a 500-class answer other than the router's 503 (no replica in service) comes from a replica
    that is up but failing, and its traceback is in its log; anything else means nothing answered."""
    if isinstance(error, _RetryableStatus) and error.status >= 500 and error.status != 503:
        return ("A replica answered with a server error: its traceback is in its log (grpo-lab async-loop keeps "
                "each replica's output in <output-dir>/logs/).")
    return "Is the router (or the vLLM server) running, with at least one replica in service?"


class LabRolloutWorker(AsyncRolloutWorker):
    """TRL's `AsyncRolloutWorker` running `LabRolloutLoop` (see the module docstring)."""

    _loop_cls = LabRolloutLoop

    def __init__(self, *, live_knobs: LiveKnobs | None = None, **kwargs):
        """TRL's arguments, forwarded as TRL does to the loop (`LabRolloutLoop`'s own among them)."""
        if live_knobs is not None:  # TRL's slots and queue sized for the knobs' upper bounds; the live values cap them
            kwargs.update(max_inflight_tasks=live_knobs.max_inflight, queue_maxsize=live_knobs.max_queue,
                          live_knobs=live_knobs)
        self.live_knobs = live_knobs
        with mock.patch.object(trl_worker, "is_vllm_available", lambda: True):  # it only speaks HTTP
            super().__init__(parent_pid=os.getpid(), **kwargs)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        """TRL's stop, minus its hang: setting the shared stop event notifies the child's waiting thread, and when
        the child was killed while waiting, `Event.set()` blocks forever (measured: the trainer never returned)."""
        if self._process is None:
            return
        if self._process.is_alive():
            setter = threading.Thread(target=self._stop_event_mp.set, name="grpo-lab-stop-event", daemon=True)
            setter.start()
            setter.join(timeout=5.0)
            self._process.join(timeout=10)
            for end in (self._process.terminate, self._process.kill):
                if self._process.is_alive():
                    end()
                    self._process.join(timeout=5)
        else:
            self._process.join(timeout=1)
        self._process = None

    def check_health(self, stale_after_s: float) -> None:
        if self._process is not None and not self._failed_event.is_set() and not self._process.is_alive():
            raise RuntimeError(f"The rollout worker process (pid {self._process.pid}) exited with code "
                               f"{self._process.exitcode} without reporting an error; see its output above.")
        super().check_health(stale_after_s)
