"""The router's membership endpoints and who may call them (docs/serving.md, "Security: binding beyond loopback").

    GET    /router/replicas                       the members and their states (client key, like /router/state)
    POST   /router/replicas {"url": ..., "wait_s": 30}     add a replica; wait up to wait_s for its admission
    DELETE /router/replicas {"url": ..., "drain_s": 30}    remove one; its completions may finish for drain_s

Changing the membership decides where every rollout and adapter load goes, so it takes the admin key when one is
set, and only that key; without one it is allowed on a loopback router only (403 elsewhere).
"""

from __future__ import annotations

import logging
import math

from aiohttp import web

from .membership import Membership
from .config import RouterConfig, is_loopback
from ..wire.vllm_routes import error_response, unauthorized

log = logging.getLogger(__name__)

PATH = "/router/replicas"
MAX_WAIT_S = 3600.0


class AdminAPI:
    """`GET`/`POST`/`DELETE /router/replicas` for one router; `read_json` is the router's body reader (size and
    time limits, vLLM-shaped 400s)."""

    def __init__(self, membership: Membership, config: RouterConfig, admin_key: str | None, read_json):
        self.membership, self.config, self._read_json = membership, config, read_json
        self._key = admin_key

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get(PATH, self.list)
        router.add_post(PATH, self.add)
        router.add_delete(PATH, self.remove)

    def bypasses_client_auth(self, request: web.Request) -> bool:
        """A membership change with an admin key configured is checked against that key only."""
        return bool(self._key) and request.path == PATH and request.method in ("POST", "DELETE")

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self._key:
            return unauthorized(request, self._key)
        if not is_loopback(self.config.host):
            return error_response(403, "membership changes are disabled on a router that is not on loopback unless an "
                                  "admin key is set (--admin-api-key-env or --admin-api-key-file)", "Forbidden")
        return None

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    async def _body(self, request: web.Request, seconds_field: str, default_s: float) -> tuple[str, float]:
        """(url, seconds) from the JSON body or the query string; ValueError saying what is wrong."""
        body = (await self._read_json(request))[0] if request.can_read_body else {}
        fields = {**request.query, **body}
        url = fields.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError("'url' (the replica's base URL, http://host:port) is required")
        seconds = fields.get(seconds_field, default_s)
        try:
            seconds = float(seconds)
        except (TypeError, ValueError):
            raise ValueError(f"'{seconds_field}' must be a number of seconds") from None
        if not 0 <= seconds <= MAX_WAIT_S or math.isnan(seconds):
            raise ValueError(f"'{seconds_field}' must be between 0 and {MAX_WAIT_S:g}")
        return url, seconds

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"replicas": self.membership.members()})

    async def add(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        try:
            url, wait_s = await self._body(request, "wait_s", 0.0)
            known = self.membership.pool.member(url.rstrip("/")) is not None
            replica = await self.membership.add(url, wait_s)
        except ValueError as error:
            return error_response(400, self._scrub(str(error)), param="url")
        if not known:
            log.info("replica %s added through %s", self._scrub(replica["url"]), PATH)
        return web.json_response({**replica, "added": not known})

    async def remove(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        try:
            url, drain_s = await self._body(request, "drain_s", self.config.remove_drain_timeout_s)
            replica = await self.membership.remove(url, drain_s)
        except ValueError as error:
            return error_response(400, self._scrub(str(error)), param="url")
        if replica is None:
            return error_response(404, self._scrub(f"{url} is not a replica of this router"), "NotFoundError",
                                  param="url")
        return web.json_response(replica)
