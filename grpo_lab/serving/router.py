"""The prefix-aware router: several vLLM replicas behind one URL that TRL's AsyncGRPOTrainer takes for one server.

To TRL it is a vLLM server with `data_parallel_size == 1` (DESIGN.md §4): `/health`, `/v1/models`, `/server_info`,
`/v1/completions`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/pause`, `/resume`. Completions are routed
by prompt prefix (`routing_policy`), adapter loads are all-or-nothing (`adapter_fanout`), replicas are watched and
re-admitted safely (`replica_pool`), and `/metrics` reports it all in Prometheus text. NCCL weight transfer cannot
be fanned out, so those endpoints are refused: train a PEFT model, for which TRL syncs adapters only.

Run it with `python -m grpo_lab.serving.router --replica http://127.0.0.1:8001 --replica ...`, or in-process
(notebooks, tests) with `start_router(RouterConfig(...))`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time

import aiohttp
from aiohttp import web

from .adapter_fanout import broadcast, load_everywhere, unload_one
from .metrics import Registry
from .replica_pool import ReplicaPool
from .router_config import RouterConfig
from .routing_policy import RoutingConfig
from .upstream import TRANSPORT_ERRORS, UpstreamClient, error_body

log = logging.getLogger(__name__)

NCCL_ENDPOINTS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/get_world_size", "/init_communicator", "/close_communicator", "/update_named_param")
NCCL_REFUSAL = ("the grpo_lab router fronts several independent replicas and cannot fan out NCCL weight transfer; "
                "adapter-only sync is required: train a PEFT (LoRA) model and start every replica with "
                "--enable-lora so AsyncGRPOTrainer syncs by /v1/load_lora_adapter")
UPSTREAM_LATENCY_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)


def _fail(status: int, message: str, kind: str = "RouterError") -> web.Response:
    return web.json_response(error_body(message, status, kind), status=status)


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    ys = sorted(xs)
    pick = lambda q: ys[min(int(q * len(ys)), len(ys) - 1)] * 1e3
    return {"n": len(ys), "p50": pick(0.5), "p99": pick(0.99), "max": ys[-1] * 1e3}


def _valid_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)


class Router:
    """The aiohttp application and its state; build with `Router(config).app()`."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = Registry()
        self._api_key = config.read_api_key()
        self.pool: ReplicaPool | None = None
        self.client: UpstreamClient | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.overhead_s: list[float] = []  # router-side time per completion (parse, route, bookkeeping), last 10k

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics_text)
        r.add_get("/v1/models", self.models)
        r.add_get("/server_info", self.server_info)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/load_lora_adapter", self.load_adapter)
        r.add_post("/v1/unload_lora_adapter", self.unload_adapter)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/router/state", self.state)
        for path in NCCL_ENDPOINTS:
            r.add_route("*", path, self.refuse_nccl)
        return app

    async def _startup(self, app) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        self.client = UpstreamClient(self._session, self._api_key)
        self.pool = ReplicaPool(self.config, self.client, self.metrics)
        self.pool.publish_states()
        self._tasks.append(asyncio.create_task(self.pool.run_health_checks(self._stop)))

    async def _cleanup(self, app) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _json(self, request: web.Request) -> tuple[dict, bytes]:
        """The request body as a JSON object, or an HTTP 400/413 error with a message."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.config.max_body_bytes, actual_size=request.content_length or 0,
                text=json.dumps(error_body(f"request body over {self.config.max_body_bytes} bytes", 413)),
                content_type="application/json") from None
        try:
            body = json.loads(raw) if raw else {}
        except ValueError as error:
            raise web.HTTPBadRequest(text=json.dumps(error_body(f"malformed JSON body: {error}", 400)),
                                     content_type="application/json") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text=json.dumps(error_body("the JSON body must be an object", 400)),
                                     content_type="application/json")
        return body, raw

    # -- read-only endpoints ----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        serving = self.pool.in_service()
        if not serving:
            return _fail(503, "no replica in service yet")
        results = await asyncio.gather(*(self.client.healthy(r, self.config.health_timeout_s) for r in serving))
        for replica, ok in zip(serving, results):
            if not ok:
                self.pool.mark_down(replica, "health check failed")
        if not all(results):
            return _fail(503, "an in-service replica failed its health check; it is being taken out of routing")
        return web.Response(text="")

    async def _from_one(self, path: str, params=None) -> web.Response:
        for replica in self.pool.in_service():
            try:
                reply = await self.client.call(replica, "GET", path, params=params,
                                               timeout=self.config.health_timeout_s)
            except TRANSPORT_ERRORS as error:
                self.pool.mark_down(replica, f"{path}: {type(error).__name__}")
                continue
            return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)
        return _fail(503, "no replica in service")

    async def models(self, request: web.Request) -> web.Response:
        return await self._from_one("/v1/models")

    async def server_info(self, request: web.Request) -> web.Response:
        """One replica's answer; admission already checked the others agree on the fields TRL reads."""
        return await self._from_one("/server_info", params=dict(request.query))

    async def metrics_text(self, request: web.Request) -> web.Response:
        policy = self.pool.policy
        for r in self.pool.replicas:
            self.metrics.set("grpo_router_in_flight", "Completions in flight per replica", policy.in_flight[r.index],
                             replica=r.url)
        self.metrics.set("grpo_router_prefix_blocks", "Block records held by the routing policy", policy.num_blocks)
        self.metrics.set("grpo_router_live_adapters", "Adapters loaded on every in-service replica",
                         len(self.pool.live_adapters))
        return web.Response(text=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def state(self, request: web.Request) -> web.Response:
        """Router state (replicas, adapters, routing counts, overhead percentiles) for notebooks and benchmarks;
        `?reset_overhead=1` restarts the overhead sample after reading it (to drop a warm-up)."""
        pool = self.pool
        answer = web.json_response({
            "replicas": [{"url": r.url, "state": r.state, "adapters": sorted(r.adapters), "last_error": r.last_error,
                          "in_flight": pool.policy.in_flight[r.index]} for r in pool.replicas],
            "live_adapters": sorted(pool.live_adapters), "paused": pool.paused,
            "routing": dict(pool.policy.counts), "block_size": pool.policy.config.block_size,
            "overhead_ms": _percentiles(self.overhead_s),
        })
        if request.query.get("reset_overhead") == "1":
            self.overhead_s.clear()
        return answer

    async def refuse_nccl(self, request: web.Request) -> web.Response:
        return _fail(501, NCCL_REFUSAL, "NotImplementedError")

    # -- completions --------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.Response:
        t_start = time.perf_counter()
        body, raw = await self._json(request)
        model, prompt = body.get("model"), body.get("prompt")
        if not isinstance(model, str) or not model:
            return _fail(400, "'model' must be a non-empty string (the base model or a loaded adapter name)")
        if not _valid_prompt(prompt):
            return _fail(400, "'prompt' must be a string or a list of non-negative integer token ids")
        if body.get("stream"):
            return _fail(400, "streaming completions are not supported by the router")
        pool, policy = self.pool, self.pool.policy
        if not pool.known_model(model):
            return _fail(404, f"The model `{model}` does not exist.", "NotFoundError")
        try:
            hashes = policy.hashes_for(prompt, model) if isinstance(prompt, list) else []
        except ValueError as error:
            return _fail(400, f"'prompt': {error}")
        tried: set[int] = set()
        upstream_s = 0.0
        for _ in range(self.config.max_reroutes + 1):
            candidates = [r for r in pool.candidates(model) if r.index not in tried]
            if not candidates:
                break
            decision = policy.route(hashes, [r.index for r in candidates])
            replica = pool.replicas[decision.replica]
            tried.add(replica.index)
            self.metrics.inc("grpo_router_routed_total", "Completions routed, by replica and decision",
                             replica=replica.url, decision=decision.kind)
            t_up = time.perf_counter()
            try:
                reply = await self.client.call(replica, "POST", "/v1/completions", data=raw,
                                               timeout=self.config.upstream_timeout_s)
            except asyncio.TimeoutError:
                policy.finish(decision, ok=False)
                return _fail(504, f"replica {replica.url} did not answer within {self.config.upstream_timeout_s}s")
            except TRANSPORT_ERRORS as error:
                policy.finish(decision, ok=False)
                # a dropped keep-alive connection is not a dead replica: take it out only if it fails a probe too
                if not await self.client.healthy(replica, min(1.0, self.config.health_timeout_s)):
                    pool.mark_down(replica, f"completion failed: {type(error).__name__}")
                upstream_s += time.perf_counter() - t_up
                self.metrics.inc("grpo_router_reroutes_total", "Completions re-routed after a replica dropped them")
                continue
            except BaseException:  # cancelled: release the claim so the replica's load stays right
                policy.finish(decision, ok=False)
                raise
            elapsed = time.perf_counter() - t_up
            upstream_s += elapsed
            self.metrics.observe("grpo_router_upstream_latency_seconds", "Upstream completion latency", elapsed,
                                 UPSTREAM_LATENCY_BUCKETS, replica=replica.url)
            ok = reply.status == 200
            policy.finish(decision, ok=ok)
            if reply.status == 404 and model in pool.live_adapters:
                pool.mark_down(replica, f"lost live adapter {model}")  # restarted under us; send elsewhere
                continue
            self._record_overhead(time.perf_counter() - t_start - upstream_s)
            if not ok:
                self.metrics.inc("grpo_router_upstream_errors_total", "Non-200 completion answers",
                                 replica=replica.url, status=str(reply.status))
                return web.Response(body=self.client.scrub(reply.text()).encode(), status=reply.status,
                                    content_type=reply.content_type)
            return web.Response(body=reply.body, status=200, content_type=reply.content_type)
        return _fail(503, f"no in-service replica could serve `{model}` (tried {len(tried)})")

    def _record_overhead(self, seconds: float) -> None:
        self.metrics.observe("grpo_router_overhead_seconds", "Router time per completion, upstream excluded",
                             seconds, OVERHEAD_BUCKETS)
        self.overhead_s.append(seconds)
        if len(self.overhead_s) > 20_000:
            del self.overhead_s[:10_000]

    # -- adapters and pause/resume ---------------------------------------------------------------------------
    async def load_adapter(self, request: web.Request) -> web.Response:
        body, _ = await self._json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _fail(400, "'lora_name' and 'lora_path' must be non-empty strings")
        if body.get("load_inplace"):
            return _fail(400, "load_inplace is not supported by the router: publish each policy under a new name")
        pool = self.pool
        async with pool.control():
            if name in pool.live_adapters:
                if pool.live_adapters[name].rstrip("/") == path.rstrip("/"):
                    return web.Response(text=f"Success: LoRA adapter '{name}' is already loaded.")
                return _fail(400, f"The lora adapter '{name}' has already been loaded from "
                                  f"{pool.live_adapters[name]!r}.", "BadRequestError")
            targets = pool.in_service()
            if not targets:
                return _fail(503, "no replica in service to load the adapter on")
            ok, outcomes = await load_everywhere(
                self.client, targets, name, path, deadline_s=self.config.load_retry_deadline_s,
                interval_s=self.config.load_retry_interval_s, timeout_s=self.config.control_timeout_s,
                on_stale=pool.mark_down)  # re-admission unloads what a failed rollback left there
            for o in outcomes:
                if o.retries:
                    self.metrics.inc("grpo_router_adapter_load_retries_total", "Load retries on 'No adapter found'",
                                     o.retries, replica=o.replica.url)
                if o.transport_error:
                    pool.mark_down(o.replica, f"adapter load failed: {o.message}")
            self.metrics.inc("grpo_router_adapter_loads_total", "Adapter loads, all-or-nothing across replicas",
                             result="ok" if ok else "failed")
            if ok:
                pool.live_adapters[name] = path
                log.info("adapter %s loaded on %d replica(s)", name, len(targets))
                return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
            return self._load_failed(name, outcomes)

    def _load_failed(self, name: str, outcomes: list) -> web.Response:
        """The failed load's error; it names the replicas whose rollback failed (now out of routing)."""
        bad = next(o for o in outcomes if not o.ok)
        rolled = sum(1 for o in outcomes if o.ok and o.newly_loaded and not o.left_loaded)
        stale = [o.replica.url for o in outcomes if o.left_loaded]
        message = f"loading adapter '{name}' failed on {bad.replica.url}: {bad.status} {bad.message}; " \
                  f"rolled back on {rolled} replica(s)"
        if stale:
            message += (f"; the rollback failed on {', '.join(stale)} (out of routing until re-admission unloads "
                        "it there), so no replica in service serves it")
        else:
            message += ", so no replica serves it"
        log.warning(message)
        return _fail(bad.status if 400 <= bad.status < 600 else 502, message, "AdapterLoadError")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        body, _ = await self._json(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _fail(400, "'lora_name' must be a non-empty string")
        pool = self.pool
        async with pool.control():
            pool.live_adapters.pop(name, None)  # first, so no new completion is routed to it
            targets = [r for r in pool.in_service() if name in r.adapters]
            outcomes = await asyncio.gather(*(unload_one(self.client, r, name, self.config.control_timeout_s)
                                              for r in targets))
            bad = [o for o in outcomes if not o.ok]
            for o in outcomes:
                if o.ok:
                    o.replica.adapters.pop(name, None)
                else:  # it may still hold the adapter: re-admission unloads it, so its slot is not lost for good
                    pool.mark_down(o.replica, f"unload of adapter {name} failed: {o.status} {o.message}")
            if bad:
                status = bad[0].status if 400 <= bad[0].status < 600 else 502
                return _fail(status, f"unloading '{name}' failed on {bad[0].replica.url}: {bad[0].status} "
                                     f"{bad[0].message}; taken out of routing until it has unloaded it")
            return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _broadcast_control(self, path: str, params=None) -> web.Response:
        pool = self.pool
        async with pool.control():
            targets = pool.in_service()
            if not targets:
                return _fail(503, f"no replica in service for {path}")
            outcomes = await broadcast(self.client, targets, "POST", path, params=params,
                                       timeout_s=self.config.control_timeout_s)
            pool.paused = path == "/pause"
            bad = [o for o in outcomes if not o.ok]
            for o in bad:
                if o.transport_error:
                    pool.mark_down(o.replica, f"{path} failed: {o.message}")
            if bad:
                return _fail(bad[0].status if bad[0].status >= 400 else 502,
                             f"{path} failed on {bad[0].replica.url}: {bad[0].status} {bad[0].message}")
            return web.json_response({"status": "paused" if pool.paused else "running"})

    async def pause(self, request: web.Request) -> web.Response:
        return await self._broadcast_control("/pause", params=dict(request.query))

    async def resume(self, request: web.Request) -> web.Response:
        return await self._broadcast_control("/resume")


# -- in-process and command-line entry points -------------------------------------------------------------------
class RouterHandle:
    """A router running on its own event loop in a daemon thread (notebooks, tests)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.router = Router(config)
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="grpo-router", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = web.AppRunner(self.router.app(), access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.config.host, self.config.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as error:  # surfaced to the caller of start(), once everything is released
            self._error = error
            try:
                self._shut_down()
            finally:
                self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._shut_down()

    def _shut_down(self) -> None:
        """Stop the health checks, close the upstream session, close the loop. Also after a failed start (port
        taken): setup has already started the health checks and opened the session by then."""
        try:
            if self._runner is not None:
                self._loop.run_until_complete(self._runner.cleanup())
        finally:
            self._loop.close()

    def start(self, timeout: float = 30.0) -> "RouterHandle":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("router did not start")
        if self._error:
            raise RuntimeError(f"router failed to start: {self._error}") from self._error
        return self

    def wait_ready(self, replicas: int | None = None, timeout: float = 60.0) -> None:
        """Block until `replicas` (default: all) replicas are in service."""
        want = len(self.config.replicas) if replicas is None else replicas
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pool = self.router.pool
            if pool is not None and len(pool.in_service()) >= want:
                return
            time.sleep(0.02)
        states = [(r.url, r.state, r.last_error) for r in self.router.pool.replicas] if self.router.pool else []
        raise TimeoutError(f"{want} replica(s) not in service after {timeout}s: {states}")

    def call(self, fn, timeout: float = 30.0):
        """Run `fn()` (sync) on the router's loop, e.g. to inspect state consistently."""
        async def wrapped():
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapped(), self._loop).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=15)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_router(config: RouterConfig) -> RouterHandle:
    """Start a router in this process and return its handle (`.url`, `.wait_ready()`, `.stop()`)."""
    return RouterHandle(config).start()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grpo_lab.serving.router", description=__doc__.split("\n")[0])
    p.add_argument("--replica", action="append", required=True, help="upstream base URL (repeat per replica)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-env", default="VLLM_API_KEY", help="env var holding the upstream bearer token")
    p.add_argument("--api-key-file", default=None, help="file holding the upstream bearer token")
    p.add_argument("--block-size", type=int, default=16, help="used until the replicas report theirs")
    p.add_argument("--spill-threshold", type=int, default=8)
    p.add_argument("--max-blocks", type=int, default=1_000_000)
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--load-retry-deadline", type=float, default=30.0)
    p.add_argument("--upstream-timeout", type=float, default=600.0)
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args) -> RouterConfig:
    return RouterConfig(
        replicas=args.replica, host=args.host, port=args.port, api_key_env=args.api_key_env,
        api_key_file=args.api_key_file,
        routing=RoutingConfig(block_size=args.block_size, spill_threshold=args.spill_threshold,
                              max_blocks=args.max_blocks),
        health_interval_s=args.health_interval, load_retry_deadline_s=args.load_retry_deadline,
        upstream_timeout_s=args.upstream_timeout, max_body_bytes=args.max_body_bytes, log_level=args.log_level)


def main(argv=None) -> None:
    config = config_from_args(build_parser().parse_args(argv))
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(config)
    print(f"grpo_lab router on http://{config.host}:{config.port} -> {len(config.replicas)} replica(s)", flush=True)
    web.run_app(router.app(), host=config.host, port=config.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
