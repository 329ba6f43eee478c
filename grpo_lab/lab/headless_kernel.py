"""The kernel client the headless runner executes notebooks with: every wait on a kernel channel is cut into short
polls, so a message that has arrived is read within `POLL_SLICE_S`, whatever the event loop missed.

Why (issue 43): nbclient 0.11 waits for a cell's reply with one `poll(timeout)` of the cell's whole timeout, and
pyzmq 27's asyncio poll is woken edge-triggered by ZeroMQ's file descriptor; a lost wake-up leaves the reply queued
until the timer fires, and the cell "succeeds" after waiting out its whole timeout. Short polls repeat the final
check every `POLL_SLICE_S`; the runner also fails a cell that took its whole timeout.
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
