"""The router's face to runs that share its replicas (`tenancy`): who is calling, what each run sees and may do, and
the lease that reclaims a dead run's adapters.

    POST   /router/runs {"name", "max_staleness", "weight", "replace"}   admin: register; the answer holds the
                                                                          run's token, the only time it is shown
    GET    /router/runs                                                   admin: the runs (never their tokens)
    GET    /router/runs/<name>                                            admin, or the run itself
    DELETE /router/runs/<name>                                            admin, or the run itself: its adapters are
                                                                          unloaded (after their drain), it is removed

With a run's token the vLLM endpoints answer as a vLLM server holding only that run's adapters would, so TRL's
`AsyncGRPOTrainer` needs nothing but the `Authorization: Bearer` header:

- loads and unloads name the run's own adapter (`trl-policy-v3`); the replicas get `<run>--trl-policy-v3`. A load
  that would exceed the run's slots (`max_loras_for(max_staleness)`) waits for the run's own draining adapters, then
  answers 409 naming what it holds: never an eviction. A name containing `--` is 403 (it would address a namespace);
  any other run's adapter cannot even be named (it maps into the caller's namespace), so it answers vLLM's 404.
- completions: the model is mapped the same way (an unknown name, another run's included, is vLLM's 404 "The model
  `x` does not exist."), waits for its turn in `fair_queue`, and the answer names the adapter as the run did.
- `/v1/models`: the base models and the run's own adapters; `/server_info`: the replicas', with `lora_config.
  max_loras` the run's share (what TRL checks against `max_staleness + 2`).
- `/pause`, `/resume`, `/is_paused`: the run's own pause (its queued completions wait; a shared replica cannot be
  paused for one run, and an adapter-only sync does not need it: each rollout names its version).
- `/router/state` and `/metrics`: the run's view (its routing counts, in flight per replica, queue, adapters;
  series labelled with another run are left out).

The admin key sees the whole pool (names as the replicas know them, every run), pauses the replicas themselves and
changes the membership; it loads, unloads and completes nothing (403: adapters belong to runs). `/health` is open
(as vLLM leaves it with an API key); any other caller is 401. Every request of a run renews its lease; `run_leases`
removes a run silent for `lease_s` with nothing in flight or queued (its process was killed), unloading only its
adapters. Tokens are never logged or echoed: the registry
keeps digests, and no log line or error names one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections import deque

from aiohttp import web

from ..adapters.slots import DEFAULT_MAX_STALENESS
from ..wire.client_watch import client_closed_response, client_gone, unless_client_gone
from .fair_queue import FairQueue
from .runs import SEPARATOR, Run, RunRegistry, TenancyError
from ..wire.upstream import now
from ..wire.vllm_routes import error_response, pause_mode_refusal

log = logging.getLogger(__name__)

RUNS = "/router/runs"
RUN = web.RequestKey("grpo_lab_run", Run)  # the run a request authenticated as
IS_ADMIN = web.RequestKey("grpo_lab_admin", bool)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)
DEFAULT_COST = 16  # tokens a completion without `max_tokens` is counted as, for fair shares
AUDIT = 1000  # unloads remembered for /router/state


def _renamed(answer: web.Response, upstream: str, shown: str) -> web.Response:
    """A lifecycle answer with the run's own adapter name where it says the namespaced one."""
    return web.Response(body=answer.body.replace(upstream.encode(), shown.encode()), status=answer.status,
                        content_type=answer.content_type)


def _forbidden(message: str, param: str | None = None) -> web.Response:
    return error_response(403, message, "Forbidden", param=param)


def _namespaced(name: str, param: str = "lora_name") -> web.Response:
    """A name that would address a namespace (another run's, or its own by the replicas' name): refused."""
    return _forbidden(f"names may not contain '{SEPARATOR}' on a shared pool (it separates a run from its "
                      f"adapters): name your own adapters as you loaded them", param=param)


class TenantAPI:
    """Runs of one `Router` (built by it when `RouterConfig.tenancy` is set); the handlers the router registers."""

    def __init__(self, router, admin_key: str):
        self.router = router
        self.config = router.config.tenancy
        self.registry = RunRegistry(self.config)
        self.queue = FairQueue(self._capacity)
        self._admin = f"Bearer {admin_key}".encode()
        self.unloads: deque = deque(maxlen=AUDIT)  # who unloaded which run's adapter, and why

    @property
    def pool(self):
        return self.router.pool

    @property
    def metrics(self):
        return self.router.metrics

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post(RUNS, self.register)
        r.add_get(RUNS, self.list_runs)
        r.add_get(RUNS + "/{name}", self.get_run)
        r.add_delete(RUNS + "/{name}", self.delete_run)

    # -- who is calling --------------------------------------------------------------------------------------------
    def authenticate(self, request: web.Request) -> web.Response | None:
        """Mark the request as the admin's or a run's (`request[RUN]`, its lease renewed), or refuse it."""
        if request.path == "/health":  # open, as on vLLM with an API key: it says nothing about any run
            return None
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), self._admin):
            request[IS_ADMIN] = True
            return None
        run = self.registry.authenticate(given[7:] if given.startswith("Bearer ") else "")
        if run is None:
            return web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's answer
        run.touch()
        request[RUN] = run
        path = request.path
        if path.startswith("/router/") and path not in ("/router/state", f"{RUNS}/{run.name}"):
            return _forbidden("a run's token opens the vLLM endpoints, /metrics, /router/state and its own "
                              f"{RUNS}/{run.name}; this one needs the pool's admin key")
        return None

    def _capacity(self) -> int:
        return self.config.max_in_flight_per_replica * max(1, len(self.pool.in_service()))

    def adapter_slots(self) -> int | None:
        """Adapter slots per replica to share out: the fewest any replica in service has (None: none known yet)."""
        known = [r.max_loras for r in self.pool.in_service() if r.max_loras]
        slots = min(known) if known else None
        if self.config.adapter_slots is not None:
            slots = self.config.adapter_slots if slots is None else min(slots, self.config.adapter_slots)
        return slots

    # -- registration ------------------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        if not request.get(IS_ADMIN):
            return _forbidden("registering a run needs the pool's admin key")
        body, _ = await self.router._json(request)
        replace = body.get("replace", False)
        if not isinstance(replace, bool):
            return error_response(400, "'replace' must be true or false", param="replace")
        try:
            answer = self.add_run(body.get("name"), body.get("max_staleness", DEFAULT_MAX_STALENESS),
                                  body.get("weight", 1.0), replace)
        except TenancyError as error:
            return error_response(error.status, str(error), error.kind)
        return web.json_response(answer, status=201)

    def add_run(self, name, max_staleness=DEFAULT_MAX_STALENESS, weight=1.0, replace: bool = False) -> dict:
        """Register a run (TenancyError says why not); its description with its `token`, shown this once."""
        run, token = self.registry.register(name, max_staleness, weight, self.adapter_slots(), replace=replace)
        self.queue.forget(run.name)  # a replaced run's queued completions belong to the process it replaces
        run.paused = False
        self.queue.set_paused(run.name, False)
        self.queue.set_weight(run.name, run.weight)
        self.metrics.inc("grpo_router_runs_registered_total", "Runs registered (or re-registered to resume)",
                         run=run.name)
        log.info("run %s %s: weight %g, max_staleness %d, %d adapter slots per replica", run.name,
                 "re-registered" if replace else "registered", run.weight, run.max_staleness, run.slots)
        return {**self.describe(run), "token": token, "lease_s": self.config.lease_s}

    async def list_runs(self, request: web.Request) -> web.Response:
        if not request.get(IS_ADMIN):
            return _forbidden("listing the runs needs the pool's admin key")
        return web.json_response({"runs": [self.describe(r) for r in self.registry.runs.values()],
                                  "adapter_slots": self.adapter_slots(),
                                  "slots_taken": self.registry.slots_taken(), "lease_s": self.config.lease_s})

    def _named_run(self, request: web.Request) -> Run | web.Response:
        name = request.match_info["name"]
        run = self.registry.runs.get(name)
        if run is None:
            return error_response(404, f"no run '{name}' on this router", "NotFoundError")
        return run

    async def get_run(self, request: web.Request) -> web.Response:
        run = self._named_run(request)
        if isinstance(run, web.Response):
            return run
        return web.json_response({**self.describe(run), "lease_s": self.config.lease_s})

    async def delete_run(self, request: web.Request) -> web.Response:
        run = self._named_run(request)
        if isinstance(run, web.Response):
            return run
        by = "admin" if request.get(IS_ADMIN) else "run"
        unloaded = await self.remove(run, by, f"DELETE {RUNS}/{run.name}")
        return web.json_response({"name": run.name, "removed": True, "unloaded": unloaded})

    def describe(self, run: Run) -> dict:
        live, draining = self._held(run)
        share = self.queue.shares.get(run.name)
        weights = sum(r.weight for r in self.registry.runs.values()) or run.weight
        return {**run.describe(), "adapters": sorted(run.client_name(n) for n in live),
                "draining": sorted(run.client_name(n) for n in draining), "slots_used": len(live | draining),
                "weight_share": run.weight / weights, "runs_sharing": len(self.registry.runs),
                "queued": len(share.queue) if share else 0, "in_flight": share.in_flight if share else 0,
                "granted": share.granted if share else 0,
                "queue_wait_s": round(share.waited_s, 3) if share else 0.0}

    # -- leases and removal ----------------------------------------------------------------------------------------
    async def run_leases(self, stop: asyncio.Event) -> None:
        """Reclaim runs whose lease lapsed; also re-grant queue places (replicas re-admitted add capacity)."""
        interval = min(max(self.config.lease_s / 4, 0.05), 0.5)
        while not stop.is_set():
            self.queue.kick()
            for run in self.registry.lapsed(self.queue.busy):
                try:
                    await self.remove(run, "lease", f"no request for {run.idle_s():.1f}s (lease "
                                                    f"{self.config.lease_s:g}s): its process is gone")
                except Exception:  # one failed removal must not end the leases of the others
                    log.exception("reclaiming run %s failed", run.name)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def remove(self, run: Run, by: str, why: str) -> list[str]:
        """Remove `run` (its token stops working at once) and unload its adapters (each after its drain); the other
        runs' adapters are not touched. Returns the adapters unloaded, by the run's names."""
        if self.registry.runs.get(run.name) is not run:
            return []
        self.registry.unregister(run.name)
        self.queue.forget(run.name)
        names = sorted(n for n in self.pool.live_adapters if run.owns(n))
        for name in names:
            await self._unload(name, run, by, why)
        self.metrics.inc("grpo_router_runs_removed_total", "Runs removed, by who removed them (run, admin, lease)",
                         run=run.name, by=by)
        self.metrics.drop_gauges(run=run.name)
        log.info("run %s removed by %s (%s): %d adapter(s) unloaded", run.name, by, why, len(names))
        return [run.client_name(n) for n in names]

    async def _unload(self, upstream: str, owner: Run, by: str, why: str) -> web.Response:
        answer = await self.router.adapters.unload({"lora_name": upstream})
        self.unloads.append({"time": time.time(), "adapter": upstream, "run": owner.name, "by": by, "why": why,
                             "status": answer.status})
        if answer.status == 200:
            self.metrics.inc("grpo_router_run_adapter_unloads_total", "Adapters of each run unloaded, by who asked "
                             "(run, admin, lease)", run=owner.name, by=by)
        return answer

    # -- the vLLM endpoints as a run sees them ---------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return await self.router.health(request)

    async def models(self, request: web.Request) -> web.Response:
        run = request.get(RUN)
        answer = await self.router.models(request)
        if run is None or answer.status != 200:
            return answer
        body = json.loads(answer.body)
        entries = [e for e in body.get("data", []) if isinstance(e, dict)]
        body["data"] = [e if not e.get("parent") else {**e, "id": run.client_name(e.get("id", ""))}
                        for e in entries if not e.get("parent") or run.owns(str(e.get("id", "")))]
        return web.json_response(body)

    async def server_info(self, request: web.Request) -> web.Response:
        run = request.get(RUN)
        answer = await self.router.server_info(request)
        if run is None or answer.status != 200:
            return answer
        body = json.loads(answer.body)
        lora = (body.get("vllm_config") or {}).get("lora_config") if isinstance(body, dict) else None
        if isinstance(lora, dict):
            lora["max_loras"] = run.slots  # what this run may hold: TRL checks it against max_staleness + 2
            if "max_cpu_loras" in lora:
                lora["max_cpu_loras"] = run.slots
        return web.json_response(body)

    async def completions(self, request: web.Request) -> web.Response:
        t_start = time.perf_counter()
        body, raw = await self.router._json(request)
        run = request.get(RUN)
        if run is None:
            return _forbidden("completions on a shared pool need a run's token (adapters belong to runs)")
        model = body.get("model")
        shown = model if isinstance(model, str) and model else None
        if shown is not None and SEPARATOR in shown:
            return _namespaced(shown, "model")
        if shown is not None and not self.pool.is_base_model(shown):
            body = {**body, "model": run.upstream(shown)}
            raw = json.dumps(body).encode()
        elif not self.config.allow_base_model:
            return _forbidden(f"runs on this pool may not use the base model{f' `{shown}`' if shown else ''}: name "
                              "one of your adapters", param="model")

        def gate(max_tokens, deadline: float):
            return self._queued(run, request, max_tokens, deadline)

        answer = await unless_client_gone(request, self.router.complete(body, raw, t_start, shown=shown, gate=gate,
                                                                       run=run.name))
        if answer is None:  # a dead client's completion renews nothing: its run's lease may lapse
            answer = client_closed_response()
        else:
            run.touch()
        self.metrics.inc("grpo_router_run_completions_total", "Completion requests of each run, by status",
                         run=run.name, status=str(answer.status))
        return answer

    @contextlib.asynccontextmanager
    async def _queued(self, run: Run, request: web.Request, max_tokens, deadline: float):
        """A place in the pool for one prompt of `run`, waited for fairly (`fair_queue`) until `deadline`."""
        cost = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 \
            else DEFAULT_COST
        began = now()

        async with self.queue.slot(run.name, cost, gone=lambda: client_gone(request),
                                   timeout_s=max(deadline - now(), 0.0)):
            self.metrics.observe("grpo_router_run_queue_wait_seconds", "Time completions waited for a place in the "
                                 "shared pool, per run", now() - began, QUEUE_BUCKETS, run=run.name)
            yield

    async def load_adapter(self, request: web.Request) -> web.Response:
        body, _ = await self.router._json(request)
        run = request.get(RUN)
        if run is None:
            return _forbidden("adapter loads on a shared pool need a run's token (adapters belong to runs)")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name or not isinstance(body.get("lora_path"), str):
            return await self.router.adapters.load(body)  # vLLM's own answers to a malformed body
        if SEPARATOR in name:
            return _namespaced(name)
        if self.pool.is_base_model(name):
            return error_response(400, f"The lora adapter '{name}' conflicts with a served base model.",
                                  "InvalidUserInput")
        upstream = run.upstream(name)
        refused = await self._make_room(run, upstream)
        if refused is not None:
            return refused
        run.loading.add(upstream)
        try:
            answer = await self.router.adapters.load({**body, "lora_name": upstream})
        finally:
            run.loading.discard(upstream)
        self.metrics.inc("grpo_router_run_adapter_loads_total", "Adapter loads of each run", run=run.name,
                         result="ok" if answer.status == 200 else "failed")
        if answer.status == 200 and self.registry.runs.get(run.name) is not run:  # removed while it loaded
            await self._unload(upstream, run, "lease", "the run was removed while this adapter loaded")
            return error_response(410, f"run '{run.name}' was removed while '{name}' loaded; it was unloaded again",
                                  "Gone")
        return _renamed(answer, upstream, name)

    def _held(self, run: Run) -> tuple[set[str], set[str]]:
        live = {n for n in self.pool.live_adapters if run.owns(n)}
        draining = {n for r in self.pool.replicas for n in r.draining if run.owns(n)}
        return live, draining

    async def _make_room(self, run: Run, upstream: str) -> web.Response | None:
        """None when `run` has a slot for `upstream` (waiting, bounded, for its own drains); else its 409."""
        deadline = now() + self.router.config.unload_drain_timeout_s
        while True:
            live, draining = self._held(run)
            held = live | draining | run.loading
            if len(held | {upstream}) <= run.slots:
                return None
            if not draining or now() >= deadline:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.pool.slot_freed.wait(), deadline - now())
        self.metrics.inc("grpo_router_run_refusals_total", "Requests of a run refused, by reason", run=run.name,
                         reason="slots")
        names = ", ".join(sorted(run.client_name(n) for n in held))
        return error_response(409, f"run '{run.name}' holds {len(held)} of its {run.slots} adapter slots per replica "
                              f"(max_staleness {run.max_staleness} + 3: {names}); unload an older version first (TRL "
                              "unloads the version that left the staleness window after each load), or register the "
                              "run with a larger max_staleness", "Conflict", param="lora_name")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        body, _ = await self.router._json(request)
        run = request.get(RUN)
        if run is None:
            return _forbidden("adapter unloads on a shared pool need a run's token (adapters belong to runs)")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return await self.router.adapters.unload(body)
        if SEPARATOR in name:
            return _namespaced(name)
        upstream = run.upstream(name)  # whatever it names, it is in this run's namespace: never another run's
        return _renamed(await self._unload(upstream, run, "run", "unload requested by the run"), upstream, name)

    async def pause(self, request: web.Request) -> web.Response:
        run = request.get(RUN)
        if run is None:
            return await self.router.pause(request)  # the admin pauses the replicas themselves
        refused = pause_mode_refusal(request.query.get("mode", "abort"))
        if refused is not None:
            return refused
        run.paused = True
        self.queue.set_paused(run.name, True)
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        run = request.get(RUN)
        if run is None:
            return await self.router.resume(request)
        run.paused = False
        self.queue.set_paused(run.name, False)
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        run = request.get(RUN)
        if run is None:
            return await self.router.is_paused(request)
        return web.json_response({"is_paused": run.paused})

    # -- what a run sees of the router ---------------------------------------------------------------------------
    async def state(self, request: web.Request) -> web.Response:
        run = request.get(RUN)
        answer = await self.router.state(request)
        if run is None:  # the admin: the pool, every run, and who unloaded what
            body = json.loads(answer.body)
            body["runs"] = {r.name: self.describe(r) for r in self.registry.runs.values()}
            body["run_routing"] = self.router.forwarder.run_routing
            body["unloads"] = list(self.unloads)
            return web.json_response(body)
        live, draining = self._held(run)
        usage, in_flight = self.router.adapters.drainer.usage, self.router.forwarder.run_in_flight
        replicas = [{"url": r.url, "index": r.index, "state": r.state, "last_error": r.last_error,
                     "adapters": sorted(run.client_name(n) for n in r.adapters if run.owns(n)),
                     "draining": sorted(run.client_name(n) for n in r.draining if run.owns(n)),
                     "in_flight": in_flight.get((run.name, r.index), 0)} for r in self.pool.replicas]
        routing = self.router.forwarder.run_routing.get(run.name, {"affinity": 0, "spilled": 0, "unmatched": 0})
        return web.json_response({
            "run": self.describe(run), "replicas": replicas, "live_adapters": sorted(run.client_name(n) for n in live),
            "draining": {run.client_name(n): {r.url: usage.in_flight(r.index, n) for r in self.pool.replicas
                                              if n in r.draining} for n in sorted(draining)},
            "paused": run.paused, "routing": dict(routing), "block_size": self.pool.policy.config.block_size})

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.router.refresh_gauges()
        self._publish_run_gauges()
        run = request.get(RUN)
        keep = None if run is None else (lambda labels: labels.get("run", run.name) == run.name)
        return web.Response(text=self.metrics.render(keep), content_type="text/plain", charset="utf-8")

    def _publish_run_gauges(self) -> None:
        m = self.metrics
        for name, run in self.registry.runs.items():
            share = self.queue.shares.get(name)
            live, draining = self._held(run)
            m.set("grpo_router_run_queued", "Completions of the run waiting for a place", len(share.queue)
                  if share else 0, run=name)
            m.set("grpo_router_run_in_flight", "Completions of the run running on replicas",
                  share.in_flight if share else 0, run=name)
            m.set("grpo_router_run_adapters", "The run's live adapters", len(live), run=name)
            m.set("grpo_router_run_slots_used", "Adapter slots per replica the run holds (draining included)",
                  len(live | draining), run=name)
            m.set("grpo_router_run_slots", "Adapter slots per replica the run may hold", run.slots, run=name)
            m.set("grpo_router_run_weight", "The run's fair-share weight", run.weight, run=name)
            m.set("grpo_router_run_idle_seconds", "Seconds since the run's last request (its lease)", run.idle_s(),
                  run=name)
