"""A programmable fake vLLM replica for the router's control-path tests, in-process on loopback.

It answers what the router calls (`/health`, `/server_info`, `/v1/models`, adapter load/unload, completions) from
plain state a test can read and change: the adapters it holds (capped at `max_loras`), failures injected per
path, loads that take a while, and a switch that makes every answer malformed HTTP. It is a bare asyncio HTTP/1.1
server rather than an aiohttp app because a well-behaved server cannot send a malformed response.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http import HTTPStatus

MALFORMED = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nBad Header Without Colon\r\n\r\nok"


class FakeVLLM:
    """One replica's state and answers. Tests change the attributes from their own thread."""

    def __init__(self, max_loras: int = 4, model: str = "m"):
        self.model = model
        self.max_loras = max_loras
        self.adapters: dict[str, str] = {}  # lora name -> path
        self.failures: dict[str, list[tuple[int, str]]] = {}  # path -> answers given instead, one per call
        self.malformed = False
        self.load_delay_s = 0.0
        self.models_delay_s = 0.0
        self.completion_delay_s = 0.0
        self.hang: set[str] = set()  # paths accepted and never answered
        self.garbage_completions = False  # answer completions 200 with a body that is not JSON
        self.echo_token = False  # put the Authorization header it received into completion bodies and a header
        self.missing_paths: set[str] = set()  # lora paths answered "No adapter found" forever
        self.paused = False
        self.served = 0  # completions answered 200
        self.unknown_model = 0  # completions answered 404
        self.most_adapters = 0  # the most adapters held at once
        self.calls: dict[str, int] = {}  # requests received per path
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, path: str, status: int, text: str) -> None:
        """Answer the next call to `path` with `status` and `text` instead of handling it."""
        self.failures.setdefault(path, []).append((status, text))

    def info(self) -> dict:
        return {"vllm_config": {
            "model_config": {"model": self.model, "max_model_len": 4096, "dtype": "torch.bfloat16"},
            "cache_config": {"block_size": 16}, "parallel_config": {"data_parallel_size": 1},
            "lora_config": {"max_lora_rank": 16, "max_loras": self.max_loras}}}

    def models(self) -> dict:
        cards = [{"id": self.model, "root": self.model, "parent": None}]
        cards += [{"id": n, "root": p, "parent": self.model} for n, p in list(self.adapters.items())]
        return {"object": "list", "data": cards}

    async def answer(self, method: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, object]:
        self.calls[path] = self.calls.get(path, 0) + 1
        injected = self.failures.get(path)
        if injected:
            return injected.pop(0)
        if path in self.hang:
            await asyncio.Event().wait()
        if path == "/health":
            return 200, ""
        if path == "/server_info":
            return 200, self.info()
        if path == "/v1/models":
            await asyncio.sleep(self.models_delay_s)
            return 200, self.models()
        if path == "/v1/load_lora_adapter":
            return await self._load(body)
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(body.get("lora_name"), None) is None:
                return 404, "The lora adapter cannot be found."
            return 200, "Success"
        if path == "/v1/completions":
            model = body.get("model", self.model)
            if model != self.model and model not in self.adapters:
                self.unknown_model += 1
                return 404, f"The model `{model}` does not exist."
            await asyncio.sleep(self.completion_delay_s)
            if model != self.model and model not in self.adapters:  # unloaded while it ran
                return 404, f"The model `{model}` was unloaded while generating."
            if self.garbage_completions:
                return 200, "<html>upstream proxy error</html>"
            self.served += 1
            prompt = body.get("prompt")
            answer = {"object": "text_completion", "model": model, "port": self.port,
                      "choices": [{"index": 0, "token_ids": [len(prompt) if isinstance(prompt, list) else 0],
                                   "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "length"}],
                      "usage": {"prompt_tokens": len(prompt or []), "completion_tokens": 1,
                                "total_tokens": len(prompt or []) + 1}}
            if self.echo_token:
                answer["echo"] = (headers or {}).get("authorization", "")
            return 200, answer
        if path == "/pause":
            self.paused = True
            return 200, {"status": "paused"}
        if path == "/resume":
            self.paused = False
            return 200, {"status": "resumed"}
        return 404, "Not Found"

    async def _load(self, body: dict) -> tuple[int, object]:
        await asyncio.sleep(self.load_delay_s)
        name, path = body.get("lora_name"), body.get("lora_path")
        if path in self.missing_paths:
            return 404, f"Loading lora {name} failed: No adapter found for {path}"
        if name in self.adapters:
            return 400, f"The lora adapter '{name}' has already been loaded."
        if len(self.adapters) >= self.max_loras:
            return 400, "max_loras reached"
        self.adapters[name] = path
        self.most_adapters = max(self.most_adapters, len(self.adapters))
        return 200, "Success"

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                if self.malformed:
                    writer.write(MALFORMED)
                    await writer.drain()
                    return
                method, path, body, headers = request
                status, payload = await self.answer(method, path, body, headers)
                extra = {"X-Echo": headers.get("authorization", "")} if self.echo_token else {}
                writer.write(_response(status, payload, extra))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict, dict] | None:
    """(method, path without query, JSON body or {}, lower-cased headers), or None when the client closed."""
    line = await reader.readline()
    if not line.strip():
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    length, headers = 0, {}
    while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = header.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
        if key.strip().lower() == "content-length":
            length = int(value)
    raw = await reader.readexactly(length) if length else b""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {}
    return method, target.split("?", 1)[0], body if isinstance(body, dict) else {}, headers


def _response(status: int, payload, extra_headers: dict | None = None) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    kind = "text/plain" if isinstance(payload, str) else "application/json"
    body = text.encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (extra_headers or {}).items())
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {kind}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class FakeCluster:
    """Serves fakes on 127.0.0.1 from an event loop in a daemon thread; use as a context manager."""

    def __init__(self, *fakes: FakeVLLM):
        self.fakes = list(fakes)
        self.loop = asyncio.new_event_loop()
        self._servers: list[asyncio.base_events.Server] = []
        self._connections: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-vllm", daemon=True)

    def __enter__(self) -> "FakeCluster":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _start(self) -> None:
        for fake in self.fakes:
            server = await asyncio.start_server(self._tracked(fake), "127.0.0.1", 0)
            fake.port = server.sockets[0].getsockname()[1]
            self._servers.append(server)

    def _tracked(self, fake: FakeVLLM):
        async def handle(reader, writer):  # kept, so stopping can end connections still open (a slow load)
            task = asyncio.current_task()
            self._connections.add(task)
            try:
                await fake.serve_connection(reader, writer)
            except asyncio.CancelledError:
                pass  # stopped by `_stop`; ending normally keeps asyncio's stream callback from logging it
            finally:
                self._connections.discard(task)
        return handle

    async def _stop(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
