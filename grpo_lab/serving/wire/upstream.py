"""One upstream replica as the router sees it, and the authenticated HTTP calls made to it."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import aiohttp

IN_SERVICE, DOWN, STARTING, INCONSISTENT = "in_service", "down", "starting", "inconsistent"
STATES = (IN_SERVICE, DOWN, STARTING, INCONSISTENT)
REMOVED = "removed"  # taken out of the router's membership; never routed to, checked or re-admitted again
# Anything that means "no usable HTTP answer": a refused or dropped connection, a timeout, and also a malformed
# response (`aiohttp.ClientResponseError`), all under `aiohttp.ClientError`. A replica answering like that is
# treated as unreachable (marked down, rerouted around) rather than surfacing as a router error.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, OSError)


@dataclass
class Replica:
    """Router-side record of a replica. `adapters` is what the router has confirmed loaded there (a 200 to its own
    load, or the replica's `/v1/models` at admission); `draining` are those of them being unloaded once their
    completions finish, which take no new completions."""

    index: int
    url: str
    state: str = STARTING
    adapters: dict[str, str] = field(default_factory=dict)  # lora name -> path
    draining: set[str] = field(default_factory=set)
    base_models: set[str] = field(default_factory=set)
    max_loras: int | None = None
    last_error: str = ""
    epoch: int = 0  # admissions so far: a load that began before the last one cannot vouch for what it holds now
    calls: set = field(default_factory=set, repr=False)  # upstream completion tasks in flight, cut when it goes down
    tries: int = 0  # completion tries under way here (their adapter usage and policy claims not yet released)
    transitioning: Counter[str] = field(default_factory=Counter, repr=False)  # names being loaded or unloaded here
    transition_seq: int = 0
    recent_transitions: deque = field(default_factory=lambda: deque(maxlen=4096), repr=False)

    @property
    def serving(self) -> bool:
        return self.state == IN_SERVICE

    def has_model(self, name: str) -> bool:
        return name in self.base_models or (name in self.adapters and name not in self.draining)

    def slots_used(self) -> int:
        """Adapters held (draining ones included) plus loads under way: what counts against `max_loras`."""
        return len(self.adapters) + sum(1 for n in self.transitioning if n not in self.adapters)

    def begin_transition(self, name: str) -> None:
        """A load or unload of `name` is being sent here: its `/v1/models` entry may change at any moment."""
        self.transitioning[name] += 1
        self._log_transition(name)

    def end_transition(self, name: str) -> None:
        self.transitioning[name] -= 1
        if self.transitioning[name] <= 0:
            del self.transitioning[name]
        self._log_transition(name)

    def _log_transition(self, name: str) -> None:
        self.transition_seq += 1
        self.recent_transitions.append((self.transition_seq, name))

    def transitions_since(self, seq: int, were: set[str]) -> set[str] | None:
        """Names in transition at any time since `transition_seq` was `seq` (when `were` were); None when the log no
        longer reaches back that far (then nothing can be trusted)."""
        if self.recent_transitions and self.recent_transitions[0][0] > seq + 1:
            return None
        return were | set(self.transitioning) | {n for s, n in self.recent_transitions if s > seq}

    def cut_calls(self) -> None:
        """Cancel the completions in flight here (it stopped answering); their handlers re-send them elsewhere."""
        for task in list(self.calls):
            task.cancel()


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def upstream_session() -> aiohttp.ClientSession:
    """The router's HTTP session to its replicas, whose connections are reset, never closed gracefully, when dropped.

    A try the router cuts (its replica left routing, a hedge won, the deadline passed) is re-sent elsewhere. Closed
    gracefully, the kernel would keep retransmitting whatever of it was still unacknowledged, so behind a partition
    the request would reach the replica after the heal and run there for nobody, or find its adapter unloaded by
    then: a misroute in the replica's counts (the chaos run's `worker_partition` flake). A reset (SO_LINGER 0) drops
    it.
    """
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, socket_factory=_resetting_socket))


def _resetting_socket(addr_info) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST, drops the rest
    return sock


class UpstreamClient:
    """Makes every upstream call with the bearer token attached; the token never leaves this object."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None):
        self._session = session
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._secret = api_key

    def scrub(self, text: str) -> str:
        """Remove the token from text that is about to be logged or returned."""
        return text.replace(self._secret, "***") if self._secret else text

    async def call(self, replica: Replica, method: str, path: str, *, timeout: float, json_body=None,
                   data: bytes | None = None, params=None) -> Reply:
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        async with self._session.request(method, replica.url + path, json=json_body, data=data, params=params,
                                         headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
            if self._secret:  # from every body, a 200 answer too: a replica may echo what it was sent
                body = body.replace(self._secret.encode(), b"***")
            return Reply(resp.status, body, self.scrub(resp.content_type))

    async def healthy(self, replica: Replica, timeout: float) -> bool:
        try:
            return (await self.call(replica, "GET", "/health", timeout=timeout)).status == 200
        except TRANSPORT_ERRORS:
            return False


def error_body(message: str, status: int, kind: str = "BadRequestError", param: str | None = None) -> dict:
    """vLLM 0.31's error shape (`ErrorResponse`: `{"error": {message, type, param, code}}`), so clients parse router
    errors exactly like server errors."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def now() -> float:
    return time.monotonic()
