"""A small proxy in front of one vLLM server that lets it load adapters published on an object store.

vLLM loads a LoRA adapter only from its own file system, so on a node without the bucket mounted this sidecar takes
the server's place and forwards every request unchanged (whole: rollouts are non-streaming) except a load with an
object-store `lora_path` (copied and verified first, `cache.AdapterCache`: no manifest yet is vLLM's 404 "No adapter
found", which the router retries, a mismatch a 400), an unload (the copy goes once vLLM unloaded it) and
`/v1/models` (such an adapter reports its URL as `root`, so the router's "same path?" check compares like with like).
With `VLLM_API_KEY` set, it never downloads for a caller vLLM would turn away (docs/serving.md).

    python -m grpo_lab.serving.adapters.sidecar --upstream http://127.0.0.1:8001 --port 9001 --cache-dir /local/lora
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

import aiohttp
from aiohttp import web

from grpo_lab.lab import environment

from .cache import AdapterCache, is_remote
from ..wire.app_thread import AppThread, serve_app
from ..wire.vllm_routes import error_response, unauthorized

log = logging.getLogger(__name__)

# headers that describe one connection, not the message (RFC 9110 7.6.1), and those aiohttp recomputes
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length"}


def _forwardable(headers) -> dict:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


class AdapterSidecar:
    """The proxy for the vLLM server at `upstream`; copies go to `cache_dir` (default: a temporary folder)."""

    def __init__(self, upstream: str, cache_dir: str | None = None, api_key_env: str = "VLLM_API_KEY"):
        self.upstream = upstream.rstrip("/")
        self.cache = AdapterCache(cache_dir)
        self._api_key = environment.bearer_key(api_key_env)
        self.sources: dict[str, tuple[str, str]] = {}  # adapter loaded through here -> (its URL, its local copy)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/load_lora_adapter", self.load_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_adapter)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app) -> None:
        if self._session is not None:
            await self._session.close()
        self.cache.close()

    # -- plain forwarding -----------------------------------------------------------------------------------------
    async def _relay(self, request: web.Request, body: bytes) -> web.Response:
        if self._session is None:
            # no total deadline: a completion takes as long as it takes (the router bounds each try); no decoding, so
            # the bytes and their Content-Encoding pass on together
            self._session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10))
        try:
            async with self._session.request(request.method, self.upstream + request.rel_url.path_qs, data=body,
                                             headers=_forwardable(request.headers), allow_redirects=False) as reply:
                return web.Response(status=reply.status, headers=_forwardable(reply.headers), body=await reply.read())
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            return error_response(502, f"adapter sidecar: upstream {self.upstream} unreachable "
                                       f"({type(error).__name__}: {error})", "BadGateway")

    async def forward(self, request: web.Request) -> web.Response:
        return await self._relay(request, await request.read())

    # -- the three requests it changes ----------------------------------------------------------------------------
    async def load_adapter(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        name, url = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        if not (isinstance(name, str) and name and isinstance(url, str) and is_remote(url)):
            return await self._relay(request, raw)  # a local path, or a request vLLM answers itself
        if refused := unauthorized(request, self._api_key):  # never a download for a caller vLLM turns away
            return refused
        try:
            local = await asyncio.get_running_loop().run_in_executor(None, self.cache.materialize, name, url)
        except FileNotFoundError:
            return error_response(404, f"Loading lora {name} failed: No adapter found for {url}", "NotFoundError")
        except (ValueError, OSError) as error:
            return error_response(400, f"Loading lora {name} failed: could not copy {url} to this node "
                                       f"({type(error).__name__}: {error})", param="lora_path")
        response = await self._relay(request, json.dumps({**body, "lora_path": str(local)}).encode())
        already = b"already been loaded" in (response.body or b"")
        if response.status < 300 or (already and name not in self.sources):
            self.sources[name] = (url, str(local))
        elif not already and name not in self.sources:
            self.cache.release(name)  # vLLM refused it: a copy nothing uses
        log.info("load %s from %s via %s: %s", name, url, local, response.status)
        return response

    async def unload_adapter(self, request: web.Request) -> web.Response:
        raw = await request.read()
        response = await self._relay(request, raw)
        try:
            name = json.loads(raw).get("lora_name")
        except (ValueError, AttributeError):
            return response
        # unloaded, or not held there at all: the copy has no user left
        if (response.status < 300 or response.status == 404) and self.sources.pop(name, None) is not None:
            self.cache.release(name)
        return response

    async def models(self, request: web.Request) -> web.Response:
        response = await self._relay(request, await request.read())
        if response.status != 200 or not self.sources:
            return response
        try:
            listing = json.loads(response.body)
        except (ValueError, TypeError):
            return response
        for card in listing.get("data", []) if isinstance(listing, dict) else []:
            source = self.sources.get(card.get("id")) if isinstance(card, dict) else None
            if source is not None and card.get("root") == source[1]:
                card["root"] = source[0]
        return web.json_response(listing)


def start_sidecar(upstream: str, port: int = 0, host: str = "127.0.0.1", cache_dir: str | None = None,
                  api_key_env: str = "VLLM_API_KEY") -> AppThread:
    """A sidecar for `upstream` on its own event loop in a daemon thread of this process (port 0: a free one);
    `.url`, `.stop()`."""
    sidecar = AdapterSidecar(upstream, cache_dir, api_key_env)
    return AppThread(sidecar.app, host, port, "adapter-sidecar", "adapter sidecar").start()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grpo_lab.serving.adapters.sidecar",
                                description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="the vLLM server's base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed as READY <port>)")
    p.add_argument("--cache-dir", default=None, help="where adapter copies go (default: a temporary folder)")
    p.add_argument("--api-key-env", default="VLLM_API_KEY")
    p.add_argument("--log-level", default="WARNING")
    return p


async def _serve(sidecar: AdapterSidecar, host: str, port: int) -> None:
    runner, port = await serve_app(sidecar.app(), host, port)
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()  # closes the upstream session and removes the adapter copies


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(AdapterSidecar(a.upstream, a.cache_dir, a.api_key_env), a.host, a.port))


if __name__ == "__main__":
    main()
