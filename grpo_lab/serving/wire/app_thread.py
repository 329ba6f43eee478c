"""An aiohttp application served on its own event loop in a daemon thread of this process (notebooks, tests): what
the in-process router (`router.thread.RouterHandle`) and the adapter sidecar (`adapters.sidecar.start_sidecar`) share.

A failed start (a port taken) releases everything the application set up before the error reaches the caller.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Self

from aiohttp import web


async def serve_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app` on `host`:`port` (0: a free one); the runner (for its cleanup) and the port taken. A failed start
    cleans up what it set up."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site._server.sockets[0].getsockname()[1]


class AppThread:
    """Serves the application `make_app()` builds on `host`:`port` (port 0: a free one, `.port` once started);
    `what` names it in errors."""

    def __init__(self, make_app: Callable[[], web.Application], host: str, port: int, thread_name: str,
                 what: str = "server"):
        self.host, self.port, self.what = host, port, what
        self._make_app = make_app
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            serving = serve_app(self._make_app(), self.host, self.port)
            self._runner, self.port = self._loop.run_until_complete(serving)
        except BaseException as error:  # surfaced to the caller of start(), once everything is released
            self._error = error
        else:
            self._ready.set()
            self._loop.run_forever()
        try:
            self._shut_down()
        finally:
            self._ready.set()

    def _shut_down(self) -> None:
        """Run the application's cleanup (the router stops its health checks and closes its upstream session; the
        sidecar also removes its adapter copies), cancel what is left (idle keep-alive connections), close the
        loop. Also after a failed start: setup has already started the application's tasks by then."""
        try:
            if self._runner is not None:
                self._loop.run_until_complete(self._runner.cleanup())
            left = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
            for task in left:
                task.cancel()
            if left:
                self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        finally:
            self._loop.close()

    def start(self, timeout: float = 30.0) -> Self:
        """Serve it; returns self. TimeoutError if it is not listening within `timeout`, RuntimeError if it failed."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.what} did not start within {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"{self.what} failed to start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=15)
