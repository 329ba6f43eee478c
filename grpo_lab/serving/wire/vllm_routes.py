"""The part of vLLM's HTTP surface that async GRPO uses, as data, and vLLM's error answer.

Two servers here answer as a vLLM server: the CPU replica (in place of one) and the router (in front of several). Both
register their handlers from `VLLM_ROUTES`, so neither can lose an endpoint the other serves, and both answer errors
with `error_response` (vLLM 0.31's `{"error": {message, type, param, code}}`). Each server adds its own extras
(`/metrics`; the router's `/router/state` and its NCCL refusals).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from aiohttp import web

from .upstream import error_body


@dataclass(frozen=True)
class Route:
    """One endpoint: `handler` names the server's method that answers it; `used_for` says who calls it and why."""

    method: str
    path: str
    handler: str
    used_for: str


VLLM_ROUTES = (
    Route("GET", "/health", "health", "readiness: TRL's VLLMClient waits on it; the router's health checks"),
    Route("GET", "/v1/models", "models", "the base model and the adapters held (an adapter's `root` is its path)"),
    Route("GET", "/server_info", "server_info", "`vllm_config`: its `lora_config` makes TRL sync adapters only; "
          "the router reads block size, max_model_len and max_loras"),
    Route("POST", "/v1/completions", "completions", "the rollouts (token-id prompts, per-token logprobs)"),
    Route("POST", "/v1/load_lora_adapter", "load_adapter", "each new policy version, by TRL's weight sync"),
    Route("POST", "/v1/unload_lora_adapter", "unload_adapter", "the version that fell out of the staleness window"),
    Route("POST", "/pause", "pause", "around each weight sync (TRL sends mode=keep)"),
    Route("POST", "/resume", "resume", "after it"),
    Route("GET", "/is_paused", "is_paused", "vLLM's dev endpoint: whether generation is paused"),
)


def add_vllm_routes(router: web.UrlDispatcher, server) -> None:
    """Register `server`'s handler for every route of `VLLM_ROUTES` (a GET also answers HEAD, as aiohttp's
    `add_get` does)."""
    for route in VLLM_ROUTES:
        handler = getattr(server, route.handler)
        if route.method == "GET":
            router.add_get(route.path, handler)
        else:
            router.add_route(route.method, route.path, handler)


PAUSE_MODES = ("abort", "wait", "keep")  # vLLM 0.31's PauseMode


def pause_mode_refusal(mode: str) -> web.Response | None:
    """vLLM's answer to `/pause?mode=...` with a mode it does not know (its query validation), or None."""
    if mode in PAUSE_MODES:
        return None
    return error_response(400, f"1 validation error:\n  query.mode: Input should be 'abort', 'wait' or 'keep' (got "
                          f"{mode!r})", "Bad Request", param="mode")


def unauthorized(request: web.Request, key: str | None) -> web.Response | None:
    """vLLM's 401 unless the request carries `Bearer <key>` (compared in constant time); None when it does or when
    `key` is unset (no key: no check)."""
    given = request.headers.get("Authorization", "").encode()
    if not key or hmac.compare_digest(given, f"Bearer {key}".encode()):
        return None
    return web.json_response({"error": "Unauthorized"}, status=401)


def error_response(status: int, message: str, kind: str = "BadRequestError", param: str | None = None
                   ) -> web.Response:
    """An error answered the way vLLM answers it."""
    return web.json_response(error_body(message, status, kind, param), status=status)


def http_error(cls: type[web.HTTPException], message: str, kind: str = "BadRequestError", **kwargs
               ) -> web.HTTPException:
    """aiohttp's exception `cls` carrying vLLM's error body, for a helper that refuses by raising."""
    return cls(text=json.dumps(error_body(message, cls.status_code, kind)), content_type="application/json",
               **kwargs)
