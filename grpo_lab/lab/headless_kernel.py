"""The kernel client the headless runner executes notebooks with: every wait on a kernel channel is cut into short
polls, so a message that has arrived is read within `POLL_SLICE_S`, whatever the event loop missed.

Why: nbclient (0.11) waits for a cell's `execute_reply` with one `poll(timeout)` on the shell channel (the cell's
whole timeout, 900 s here) and for its outputs with one `poll(None)` on iopub. pyzmq's asyncio poll (27) learns of a
message from the socket's file descriptor, which ZeroMQ signals edge-triggered; if that wake-up is lost, the poll
sleeps on with the reply queued until its timer fires, and then its final non-blocking `poll(0)` finds the reply: the
cell "succeeds" after waiting out its whole timeout. That is what issue 43 saw (notebook 02's planner cell rendered,
the kernel went idle, papermill waited 900 s and reported the notebook ok, once in two runs on a busy 2-core
machine); the lost wake-up itself was not reproduced on demand. Short polls repeat that final check every
`POLL_SLICE_S`, so a missed wake-up costs at most that; the runner also fails a cell that took its whole timeout.
"""

from __future__ import annotations

import time
import typing as t
from queue import Empty

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import Type, default

POLL_SLICE_S = 1.0  # the longest a message that has arrived can wait unread


class SlicedPollChannel(AsyncZMQSocketChannel):
    """A kernel channel whose `get_msg(timeout)` polls at most `POLL_SLICE_S` at a time until `timeout` (None:
    until a message comes), raising `Empty` only once the whole timeout has passed."""

    async def get_msg(self, timeout: float | None = None) -> dict[str, t.Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else max(0.0, min(POLL_SLICE_S, deadline - time.monotonic()))
            try:
                return await super().get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class HeadlessKernelClient(AsyncKernelClient):
    """nbclient's kernel client with `SlicedPollChannel` for every channel it polls."""

    shell_channel_class = Type(SlicedPollChannel)
    iopub_channel_class = Type(SlicedPollChannel)
    stdin_channel_class = Type(SlicedPollChannel)
    control_channel_class = Type(SlicedPollChannel)


class HeadlessKernelManager(AsyncKernelManager):
    """The kernel manager papermill is given (`kernel_manager_class`): its clients are `HeadlessKernelClient`s."""

    @default("client_factory")
    def _headless_client_factory(self) -> type:
        return HeadlessKernelClient
