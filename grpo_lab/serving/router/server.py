"""The prefix-aware router: an HTTP proxy that puts several vLLM replicas behind one URL, which TRL's
AsyncGRPOTrainer takes for one server.

To TRL it is a vLLM server with `data_parallel_size == 1`: the endpoints of `vllm_routes`, answered with vLLM 0.31's
status codes and error bodies (what it does, and its deliberate differences, are in docs/serving.md); with
`RouterConfig.tenancy` each request's view (`tenancy.views`) says what its caller sees. NCCL weight transfer cannot
be fanned out, so those endpoints are refused: train a PEFT model, for which TRL syncs adapters only.

Run it with `python -m grpo_lab.serving.router.server --replica http://127.0.0.1:8001 --replica ...`, or in-process
(notebooks, tests) with `router.thread.start_router(RouterConfig(...))`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from grpo_lab.lab.settings_parser import ConfigParser

from ..adapters.fanout import broadcast
from .adapter_lifecycle import AdapterLifecycle
from .admin_api import AdminAPI
from ..replicas.processes import bind_listener
from ..wire.client_watch import unless_client_gone
from ..wire.completion_batches import PromptError, merge_batch, split_prompt
from ..tenancy.fair_queue import ClientGone
from ..routing.forwarding import Forwarder, failure
from .membership import Membership, describe
from ..wire.metrics import Registry
from .replica_pool import ReplicaPool
from .config import RouterConfig
from ..tenancy.tenant_api import RunsAPI
from ..tenancy.views import VIEW, PoolView
from ..wire.upstream import TRANSPORT_ERRORS, Reply, UpstreamClient, now, upstream_session
from ..wire.vllm_routes import add_vllm_routes, error_response, http_error, pause_mode_refusal, unauthorized

NCCL_ENDPOINTS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/get_world_size", "/init_communicator", "/close_communicator", "/update_named_param")
NCCL_REFUSAL = ("the grpo_lab router fronts several independent replicas and cannot fan out NCCL weight transfer; "
                "adapter-only sync is required: train a PEFT (LoRA) model and start every replica with "
                "--enable-lora so AsyncGRPOTrainer syncs by /v1/load_lora_adapter")


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    ys = sorted(xs)
    pick = lambda q: ys[min(int(q * len(ys)), len(ys) - 1)] * 1e3
    return {"n": len(ys), "p50": pick(0.5), "p99": pick(0.99), "max": ys[-1] * 1e3}


class Router:
    """The aiohttp application and its state; build with `Router(config).app()`."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = Registry()
        self._api_key = config.read_api_key()
        self._client_key = config.read_client_api_key()
        self._admin_key = config.read_admin_api_key()
        self.pool: ReplicaPool | None = None
        self.adapters: AdapterLifecycle | None = None
        self.client: UpstreamClient | None = None
        self.forwarder: Forwarder | None = None
        self.membership: Membership | None = None
        self.admin: AdminAPI | None = None
        self.tenancy: RunsAPI | None = None  # when runs share the replicas
        self.whole_pool = PoolView(self)  # what a caller sees without tenancy
        self._session: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._authenticate])
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        r = app.router
        self.admin = AdminAPI(None, self.config, self._admin_key, self._json)  # membership attached at startup
        if self.config.tenancy is not None:
            self.tenancy = RunsAPI(self, self._admin_key)
            self.tenancy.add_routes(r)
        add_vllm_routes(r, self)
        r.add_get("/metrics", self.metrics_text)
        r.add_get("/router/state", self.state)
        self.admin.add_routes(r)
        for path in NCCL_ENDPOINTS:
            r.add_route("*", path, self.refuse_nccl)
        return app

    def view_of(self, request: web.Request) -> PoolView:
        """What the caller sees (`tenancy.views`): a run of a shared pool, its admin, or the whole pool."""
        return request.get(VIEW, self.whole_pool)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        """With client authentication on, every endpoint needs the key (vLLM's own key leaves /health, /pause,
        /resume and /server_info open; a router that can load adapters should not). With tenancy, the admin key or
        a run's token (`tenant_api`), which sets the request's view."""
        if self.tenancy is not None:
            refused = self.tenancy.authenticate(request)
            return refused if refused is not None else await handler(request)
        refused = None if self.admin.bypasses_client_auth(request) else unauthorized(request, self._client_key)
        if refused is not None:
            return refused
        return await handler(request)

    async def _startup(self, app) -> None:
        self._session = upstream_session()
        self.client = UpstreamClient(self._session, self._api_key)
        self.pool = ReplicaPool(self.config, self.client, self.metrics)
        self.adapters = AdapterLifecycle(self.pool, self.client, self.config, self.metrics)
        self.forwarder = Forwarder(self.pool, self.client, self.adapters.drainer.usage, self.metrics, self.config)
        self.membership = self.admin.membership = Membership(self.pool, self.metrics)
        self.pool.publish_states()
        self._tasks.append(asyncio.create_task(self.pool.run_health_checks(self._stop)))
        if self.tenancy is not None:
            self.forwarder.per_replica_cap = self.config.tenancy.max_in_flight_per_replica
            self.tenancy.attach()
            self._tasks.append(asyncio.create_task(self.tenancy.run_leases(self._stop)))

    async def _cleanup(self, app) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.adapters is not None:
            await self.adapters.close()
        if self._session is not None:
            await self._session.close()

    async def _json(self, request: web.Request) -> tuple[dict, bytes]:
        """The request body as a JSON object, or an HTTP 400/408/413 error with a message."""
        try:
            async with asyncio.timeout(self.config.body_read_timeout_s):  # no extra task: a body already here
                raw = await request.read()  # is read without yielding to the loop
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_body_bytes
            raise http_error(web.HTTPRequestEntityTooLarge, f"request body over {limit} bytes",
                             "RequestEntityTooLarge", max_size=limit, actual_size=request.content_length or 0
                             ) from None
        except asyncio.TimeoutError:
            raise http_error(web.HTTPRequestTimeout, f"the request body did not arrive within "
                             f"{self.config.body_read_timeout_s}s", "RequestTimeout") from None
        try:
            body = json.loads(raw) if raw else {}
        except ValueError as error:
            raise http_error(web.HTTPBadRequest, f"malformed JSON body: {error}") from None
        if not isinstance(body, dict):
            raise http_error(web.HTTPBadRequest, "the JSON body must be an object")
        return body, raw

    # -- read-only endpoints ----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while at least one replica is in service. Answered from the health checks' state, never by asking
        the replicas, so it stays fast when one of them hangs (TRL polls it with a 5 s timeout)."""
        if not self.pool.in_service():
            return error_response(503, "no replica in service", "ServiceUnavailable")
        return web.Response(text="")

    async def _from_one(self, path: str, params=None) -> Reply:
        """The first in-service replica's answer to `GET path` (one that cannot be reached leaves routing); 503."""
        for replica in self.pool.in_service():
            try:
                return await self.client.call(replica, "GET", path, params=params,
                                              timeout=self.config.health_timeout_s)
            except TRANSPORT_ERRORS as error:
                self.pool.mark_down(replica, f"{path}: {type(error).__name__}")
        raise http_error(web.HTTPServiceUnavailable, "no replica in service", "ServiceUnavailable")

    async def models(self, request: web.Request) -> web.Response:
        """One replica's model list, with the adapters narrowed to the live ones (draining ones are gone for
        clients, and a replica may briefly hold one that is still loading elsewhere)."""
        reply = await self._from_one("/v1/models")
        body = reply.json()
        if reply.status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
            return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)
        live, view = self.pool.live_adapters, self.view_of(request)
        body["data"] = [{**m, "id": view.shown(m.get("id", ""))} if isinstance(m, dict) and m.get("parent") else m
                        for m in body["data"] if not (isinstance(m, dict) and m.get("parent"))
                        or (m.get("id") in live and view.owns(str(m.get("id"))))]
        return web.json_response(body)

    async def server_info(self, request: web.Request) -> web.Response:
        """One replica's answer (admission already checked the others agree on the fields TRL reads), with the
        caller's share of adapter slots where it has one."""
        reply = await self._from_one("/server_info", params=dict(request.query))
        slots = self.view_of(request).slots
        body = reply.json() if slots is not None and reply.status == 200 else None
        lora = (body.get("vllm_config") or {}).get("lora_config") if isinstance(body, dict) else None
        if not isinstance(lora, dict):
            return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)
        lora["max_loras"] = slots
        if "max_cpu_loras" in lora:
            lora["max_cpu_loras"] = slots
        return web.json_response(body)

    async def metrics_text(self, request: web.Request) -> web.Response:
        """The metrics, with the gauges that describe the pool now (in flight, draining, block records, live
        adapters) set first."""
        policy, pool, usage = self.pool.policy, self.pool, self.adapters.drainer.usage
        for r in pool.replicas:
            self.metrics.set("grpo_router_in_flight", "Completions in flight per replica", policy.in_flight[r.index],
                             replica=r.url)
            self.metrics.set("grpo_router_draining_adapters", "Unloaded adapters still draining on the replica",
                             len(r.draining), replica=r.url)
            self.metrics.set("grpo_router_draining_in_flight", "Completions still using adapters draining there",
                             sum(usage.in_flight(r.index, name) for name in r.draining), replica=r.url)
        self.metrics.set("grpo_router_prefix_blocks", "Block records held by the routing policy", policy.num_blocks)
        self.metrics.set("grpo_router_live_adapters", "Adapters loaded on every in-service replica",
                         len(pool.live_adapters))
        if self.tenancy is not None:
            self.tenancy.publish_gauges()
        text = self.metrics.render(self.view_of(request).keep)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def state(self, request: web.Request) -> web.Response:
        """Router state (replicas, adapters, draining adapters, routing counts, overhead percentiles) for notebooks
        and benchmarks; `?reset_overhead=1` restarts the overhead sample after reading it (to drop a warm-up)."""
        pool = self.pool
        answer = web.json_response(self.view_of(request).state({
            "replicas": [describe(r, pool) for r in pool.replicas],
            "live_adapters": sorted(pool.live_adapters), "draining": self.adapters.drainer.draining(),
            "paused": pool.paused,
            "routing": dict(pool.policy.counts), "block_size": pool.policy.config.block_size,
            "overhead_ms": _percentiles(self.forwarder.overhead_s), "hedging": self.forwarder.state(),
        }))
        if request.query.get("reset_overhead") == "1":
            self.forwarder.overhead_s.clear()
        return answer

    async def refuse_nccl(self, request: web.Request) -> web.Response:
        return error_response(501, NCCL_REFUSAL, "NotImplementedError")

    # -- completions --------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.Response:
        t_start = time.perf_counter()
        body, raw = await self._json(request)
        view = self.view_of(request)
        asked = view.completion(body)  # a run's adapter by the replicas' name, and the name to answer with
        if isinstance(asked, web.Response):
            return asked
        forwarded, shown = asked
        if forwarded is not body:
            raw = json.dumps(forwarded).encode()
        return view.answered(await unless_client_gone(request, self.complete(
            forwarded, raw, t_start, shown=shown, gate=view.gate(request), run=view.run_name)))

    async def complete(self, body: dict, raw: bytes, t_start: float, shown: str | None = None, gate=None,
                       run: str | None = None) -> web.Response:
        """Answer one `/v1/completions` body. For a run of a shared pool (`tenancy.views.RunView`), `body["model"]`
        is already the replicas' name of its adapter and `shown` the run's own name for it (what errors and answers
        say); `gate(cost, deadline)` is the fair queue's place a prompt waits for before it is forwarded; `run` labels
        metrics."""
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            return error_response(400, "'model' must be a non-empty string (the base model or a loaded adapter "
                                  "name)", param="model")
        try:
            prompts = split_prompt(body.get("prompt"))
        except PromptError as error:
            return error_response(400, str(error), error.kind, param=error.param)
        if body.get("stream"):
            return error_response(400, "streaming completions are not supported by the router", param="stream")
        if model is not None and not self.pool.known_model(model):
            return error_response(404, f"The model `{shown or model}` does not exist.", "NotFoundError",
                                  param="model")
        model = model or next((min(r.base_models) for r in self.pool.in_service() if r.base_models), None)
        if model is None:
            return error_response(503, "no replica in service", "ServiceUnavailable")
        deadline = now() + self.config.upstream_timeout_s
        max_tokens = body.get("max_tokens")

        async def forward(prompt, data: bytes, t0: float):
            if gate is None:
                return await self.forwarder.forward(model, prompt, data, deadline, t0, max_tokens)
            try:
                async with gate(max_tokens, deadline):
                    return await self.forwarder.forward(model, prompt, data, deadline, time.perf_counter(),
                                                        max_tokens, run=run)
            except ClientGone as error:
                return failure(503, str(error), "ServiceUnavailable"), None
            except TimeoutError:
                return failure(504, f"no replica capacity for this run within the "
                                    f"{self.config.upstream_timeout_s}s deadline", "GatewayTimeout"), None

        if len(prompts) == 1:  # one prompt (or a batch of one): forwarded as sent
            reply, answer = await forward(prompts[0], raw, t_start)
        else:
            bodies = [json.dumps({**body, "prompt": p}).encode() for p in prompts]
            results = await asyncio.gather(*(forward(p, b, time.perf_counter()) for p, b in zip(prompts, bodies)))
            reply, answer = next(((r, a) for r, a in results if a is None), (None, None))
            if reply is None:  # else vLLM fails the whole batch when one prompt fails: answered as that prompt's
                merged = merge_batch([a for _, a in results])
                if shown is not None and "model" in merged:
                    merged["model"] = shown
                return web.json_response(merged)
        if shown is not None and shown != model:
            return self._renamed(reply, answer, model, shown)
        return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)

    @staticmethod
    def _renamed(reply: Reply, answer: dict | None, upstream: str, shown: str) -> web.Response:
        """A replica's answer with the run's own adapter name where the replica said the namespaced one."""
        if answer is not None and reply.status == 200:
            return web.json_response({**answer, "model": shown} if "model" in answer else answer)
        return web.Response(body=reply.body.replace(upstream.encode(), shown.encode()), status=reply.status,
                            content_type=reply.content_type)

    # -- adapters (`adapter_lifecycle`) -------------------------------------------------------------------------
    async def load_adapter(self, request: web.Request) -> web.Response:
        body, _ = await self._json(request)
        return await self.view_of(request).load(body)

    async def unload_adapter(self, request: web.Request) -> web.Response:
        body, _ = await self._json(request)
        return await self.view_of(request).unload(body)

    # -- pause/resume ---------------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        if (refused := pause_mode_refusal(request.query.get("mode", "abort"))) is not None:
            return refused  # what vLLM's query validation answers
        return await self.view_of(request).pause(True, dict(request.query))

    async def resume(self, request: web.Request) -> web.Response:
        return await self.view_of(request).pause(False, None)

    async def is_paused(self, request: web.Request) -> web.Response:
        """vLLM's dev endpoint: whether generation is paused (the router's own record of what the replicas did, or
        a run's own pause)."""
        return web.json_response({"is_paused": self.view_of(request).paused})

    async def pause_replicas(self, pausing: bool, params) -> web.Response:
        """Pause or resume every replica; the router's own state changes only when every replica agreed. A replica
        that cannot be reached (it died) leaves routing and the pause goes on with the others — it is re-admitted in
        the router's state, like any restarted replica — so with none left the answer is 503. A pause that a live
        replica refused is undone where it succeeded; a replica that failed to resume leaves routing."""
        path = "/pause" if pausing else "/resume"
        pool = self.pool
        async with pool.control_lock:
            while True:
                targets = pool.in_service()
                if not targets:
                    return error_response(503, f"no replica in service for {path}", "ServiceUnavailable")
                outcomes = await broadcast(self.client, targets, "POST", path, params=params,
                                           timeout_s=self.config.control_timeout_s)
                bad = [o for o in outcomes if not o.ok]
                if not bad or not all(o.transport_error for o in bad):
                    break
                for o in bad:  # unreachable: out of routing, then the same call on the replicas left
                    pool.mark_down(o.replica, f"{path} failed: {o.message}")
            if not bad:
                pool.paused = pausing
                return web.json_response({"status": "paused" if pausing else "resumed"})
            if pausing:
                undo = [o.replica for o in outcomes if o.ok]
                await broadcast(self.client, undo, "POST", "/resume", timeout_s=self.config.control_timeout_s)
                for o in bad:
                    if o.transport_error:
                        pool.mark_down(o.replica, f"/pause failed: {o.message}")
            else:
                pool.paused = False
                for o in bad:
                    pool.mark_down(o.replica, f"/resume failed: {o.status} {o.message}")
            first = bad[0]
            undone = "; undone on the replicas that had paused" if pausing and len(bad) < len(outcomes) else ""
            return error_response(first.status if first.status >= 400 else 502,
                                  f"{path} failed on {first.replica.url}: {first.status} {first.message}{undone}")


# -- command line ----------------------------------------------------------------------------------------------
def build_parser() -> ConfigParser:
    """The command line, generated from `RouterConfig` (its defaults, rules and docstring)."""
    return ConfigParser(RouterConfig, prog="python -m grpo_lab.serving.router.server",
                        description=__doc__.split("\n")[0])


def main(argv=None) -> None:
    parser = build_parser()
    config, _ = parser.parse(argv)
    try:
        router = Router(config)  # reads the keys: a missing key file is a user error too
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    listener = bind_listener(config.host, config.port)  # bound before it is announced: a taken port is one line
    if listener is None:
        parser.exit(2, f"{parser.prog}: error: port {config.port} is in use on {config.host} (pick another, or 0 "
                       f"for a free one)\n")
    port = listener.getsockname()[1]
    print(f"grpo_lab router on http://{config.host}:{port} -> {len(config.replicas)} replica(s)", flush=True)
    web.run_app(router.app(), sock=listener, access_log=None, print=None)


if __name__ == "__main__":
    main()
