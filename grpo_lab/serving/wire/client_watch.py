"""A completion whose client has gone is cancelled, as vLLM aborts a request whose connection closed.

aiohttp lets a handler run on after its client disconnects, so a killed trainer's rollouts would keep replicas
generating for nobody, hold a shared pool's places and keep its lease alive. The router runs each completion as a
task and cancels it once the client's connection is closed (checked every `POLL_S`); closing the upstream
connection makes a vLLM replica abort the generation too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from aiohttp import web

POLL_S = 0.25


def client_closed_response() -> web.Response:
    """What a cancelled completion answers (nobody reads it): nginx's 499, so metrics count these apart."""
    return web.Response(status=499, text="the client closed the connection; the completion was cancelled")


def client_gone(request: web.Request) -> bool:
    """Whether the client of `request` has closed its connection (no answer can reach it any more)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def unless_client_gone(request: web.Request, work: Awaitable[web.Response]) -> web.Response | None:
    """`await work`, or cancel it and return None once the client of `request` is gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if client_gone(request):
                await _cancel(task)
                return None
    except asyncio.CancelledError:  # the handler itself cancelled (the server stopping): take the work with it
        await _cancel(task)
        raise


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
