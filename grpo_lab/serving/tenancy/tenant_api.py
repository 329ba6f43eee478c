"""The router's face to runs that share its replicas (`tenancy`): who is calling, the runs themselves, and the lease
that reclaims a dead run's adapters.

`POST /router/runs` (admin: register; the answer holds the run's token, the only time it is shown), `GET` it (admin:
the runs), `GET`/`DELETE /router/runs/<name>` (admin, or the run itself). `authenticate` gives each request its view
(`views`): the admin key the whole pool, a run's token that run; `/health` is open, any other caller 401. What the
views share lives here: a run's slots (`make_room`: a load beyond them waits for the run's own drains, then is a 409,
never an eviction), its place in the fair queue (`queued`), the audited unloads, the per-run gauges. `run_leases`
removes a run silent for `lease_s` with nothing in flight or queued, unloading only its adapters. Tokens are never
logged or echoed: the registry keeps digests (docs/shared_pool.md, "What a run may do").
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import deque

from aiohttp import web

from ..adapters.drain import set_within
from ..adapters.slots import DEFAULT_MAX_STALENESS
from ..wire.client_watch import client_gone
from ..wire.upstream import now
from ..wire.vllm_routes import error_response, http_error
from .fair_queue import FairQueue, RunShare
from .runs import Run, RunRegistry, TenancyError
from .views import VIEW, AdminView, RunView, forbidden

log = logging.getLogger(__name__)

RUNS = "/router/runs"
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)
DEFAULT_COST = 16  # tokens a completion without `max_tokens` is counted as, for fair shares
AUDIT = 1000  # unloads remembered for /router/state


def _is_admin(request: web.Request) -> bool:
    return isinstance(request.get(VIEW), AdminView)


class RunsAPI:
    """Runs of one `Router` (built by it when `RouterConfig.tenancy` is set): `/router/runs`, who is calling, leases."""

    def __init__(self, router, admin_key: str):
        self.router, self.metrics = router, router.metrics
        self.config = router.config.tenancy
        self.registry = RunRegistry(self.config)
        self.queue = FairQueue(self._capacity)
        self._admin = f"Bearer {admin_key}".encode()
        self.unloads: deque = deque(maxlen=AUDIT)  # who unloaded which run's adapter, and why

    def attach(self) -> None:
        """Once the router has its pool: take back the runs of a crashed router (its state file), and have the pool
        write the runs with the rest of its state from now on."""
        for run in self.registry.restore(self.pool.saved_runs):
            self.queue.set_weight(run.name, run.weight)
            self.queue.set_paused(run.name, run.paused)
            log.info("run %s taken back from the state file: its token still works", run.name)
        self.pool.runs_state = self.registry.snapshot

    @property
    def pool(self):
        return self.router.pool

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post(RUNS, self.register)
        r.add_get(RUNS, self.list_runs)
        r.add_get(RUNS + "/{name}", self.get_run)
        r.add_delete(RUNS + "/{name}", self.delete_run)

    # -- who is calling --------------------------------------------------------------------------------------------
    def authenticate(self, request: web.Request) -> web.Response | None:
        """Give the request the admin's view or a run's (`request[VIEW]`, the run's lease renewed), or refuse it."""
        if request.path == "/health":  # open, as on vLLM with an API key: it says nothing about any run
            return None
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), self._admin):
            request[VIEW] = AdminView(self)
            return None
        run = self.registry.authenticate(given[7:] if given.startswith("Bearer ") else "")
        if run is None:
            return web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's answer
        run.touch()
        request[VIEW] = RunView(self, run)
        path = request.path
        if path.startswith("/router/") and path not in ("/router/state", f"{RUNS}/{run.name}"):
            return forbidden("a run's token opens the vLLM endpoints, /metrics, /router/state and its own "
                             f"{RUNS}/{run.name}; this one needs the pool's admin key")
        return None

    def _capacity(self) -> int:
        return self.config.max_in_flight_per_replica * max(1, len(self.pool.in_service()))

    def adapter_slots(self) -> int | None:
        """Adapter slots per replica to share out: the fewest any replica in service has (None: none known yet)."""
        known = [r.max_loras for r in self.pool.in_service() if r.max_loras]
        if self.config.adapter_slots is not None:
            known.append(self.config.adapter_slots)
        return min(known, default=None)

    # -- registration ------------------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        if not _is_admin(request):
            return forbidden("registering a run needs the pool's admin key")
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
        self.pool.save_state()
        self.metrics.inc("grpo_router_runs_registered_total", "Runs registered (or re-registered to resume)",
                         run=run.name)
        log.info("run %s %s: weight %g, max_staleness %d, %d adapter slots per replica", run.name,
                 "re-registered" if replace else "registered", run.weight, run.max_staleness, run.slots)
        return {**self.describe(run), "token": token, "lease_s": self.config.lease_s}

    async def list_runs(self, request: web.Request) -> web.Response:
        if not _is_admin(request):
            return forbidden("listing the runs needs the pool's admin key")
        return web.json_response({"runs": [self.describe(r) for r in self.registry.runs.values()],
                                  "adapter_slots": self.adapter_slots(),
                                  "slots_taken": self.registry.slots_taken(), "lease_s": self.config.lease_s})

    def _named_run(self, request: web.Request) -> Run:
        name = request.match_info["name"]
        if (run := self.registry.runs.get(name)) is None:
            raise http_error(web.HTTPNotFound, f"no run '{name}' on this router", "NotFoundError")
        return run

    async def get_run(self, request: web.Request) -> web.Response:
        run = self._named_run(request)
        return web.json_response({**self.describe(run), "lease_s": self.config.lease_s})

    async def delete_run(self, request: web.Request) -> web.Response:
        run = self._named_run(request)
        by = "admin" if _is_admin(request) else "run"
        unloaded = await self.remove(run, by, f"DELETE {RUNS}/{run.name}")
        return web.json_response({"name": run.name, "removed": True, "unloaded": unloaded})

    def describe(self, run: Run) -> dict:
        live, draining = self.held(run)
        share = self.queue.shares.get(run.name) or RunShare()  # none yet: nothing queued or granted
        weights = sum(r.weight for r in self.registry.runs.values()) or run.weight
        return {**run.describe(), "adapters": sorted(run.client_name(n) for n in live),
                "draining": sorted(run.client_name(n) for n in draining), "slots_used": len(live | draining),
                "weight_share": run.weight / weights, "runs_sharing": len(self.registry.runs),
                "queued": self.queue.queued(run.name), "in_flight": share.in_flight, "granted": share.granted,
                "queue_wait_s": round(share.waited_s, 3)}

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
            await set_within(stop, interval)

    async def remove(self, run: Run, by: str, why: str) -> list[str]:
        """Remove `run` (its token stops working at once) and unload its adapters (each after its drain); the other
        runs' adapters are not touched. Returns the adapters unloaded, by the run's names."""
        if self.registry.runs.get(run.name) is not run:
            return []
        self.registry.unregister(run.name)
        self.pool.save_state()
        self.queue.forget(run.name)
        names = sorted(n for n in self.pool.live_adapters if run.owns(n))
        for name in names:
            await self.unload(name, run, by, why)
        self.metrics.inc("grpo_router_runs_removed_total", "Runs removed, by who removed them (run, admin, lease)",
                         run=run.name, by=by)
        self.metrics.drop_gauges(run=run.name)
        log.info("run %s removed by %s (%s): %d adapter(s) unloaded", run.name, by, why, len(names))
        return [run.client_name(n) for n in names]

    async def unload(self, upstream: str, owner: Run, by: str, why: str) -> web.Response:
        """Unload one of `owner`'s adapters (after its drain), remembering who asked and why."""
        answer = await self.router.adapters.unload({"lora_name": upstream})
        self.unloads.append({"time": time.time(), "adapter": upstream, "run": owner.name, "by": by, "why": why,
                             "status": answer.status})
        if answer.status == 200:
            self.metrics.inc("grpo_router_run_adapter_unloads_total", "Adapters of each run unloaded, by who asked "
                             "(run, admin, lease)", run=owner.name, by=by)
        return answer

    # -- what the run views share ----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def queued(self, run: Run, request: web.Request, max_tokens, deadline: float):
        """A place in the pool for one prompt of `run`, waited for fairly (`fair_queue`) until `deadline`."""
        cost = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 \
            else DEFAULT_COST
        began = now()

        async with self.queue.slot(run.name, cost, gone=lambda: client_gone(request),
                                   timeout_s=max(deadline - now(), 0.0)):
            self.metrics.observe("grpo_router_run_queue_wait_seconds", "Time completions waited for a place in the "
                                 "shared pool, per run", now() - began, QUEUE_BUCKETS, run=run.name)
            yield

    def held(self, run: Run) -> tuple[set[str], set[str]]:
        live = {n for n in self.pool.live_adapters if run.owns(n)}
        draining = {n for r in self.pool.replicas for n in r.draining if run.owns(n)}
        return live, draining

    async def make_room(self, run: Run, upstream: str) -> web.Response | None:
        """None when `run` has a slot for `upstream` (waiting, bounded, for its own drains); else its 409."""
        deadline = now() + self.router.config.unload_drain_timeout_s
        while True:
            live, draining = self.held(run)
            held = live | draining | run.loading
            if len(held | {upstream}) <= run.slots:
                return None
            if not draining or now() >= deadline:
                break
            await set_within(self.pool.slot_freed, deadline - now())
        self.metrics.inc("grpo_router_run_refusals_total", "Requests of a run refused, by reason", run=run.name,
                         reason="slots")
        names = ", ".join(sorted(run.client_name(n) for n in held))
        return error_response(409, f"run '{run.name}' holds {len(held)} of its {run.slots} adapter slots per replica "
                              f"(max_staleness {run.max_staleness} + 3: {names}); unload an older version first (TRL "
                              "unloads the version that left the staleness window after each load), or register the "
                              "run with a larger max_staleness", "Conflict", param="lora_name")

    def publish_gauges(self) -> None:
        """Each run's gauges (queue, in flight, adapters, slots, weight, idle time) for `/metrics`."""
        for name, run in self.registry.runs.items():
            d = self.describe(run)
            for gauge, what, value in (
                    ("grpo_router_run_queued", "Completions of the run waiting for a place", d["queued"]),
                    ("grpo_router_run_in_flight", "Completions of the run running on replicas", d["in_flight"]),
                    ("grpo_router_run_adapters", "The run's live adapters", len(d["adapters"])),
                    ("grpo_router_run_slots_used", "Adapter slots per replica the run holds (draining included)",
                     d["slots_used"]),
                    ("grpo_router_run_slots", "Adapter slots per replica the run may hold", run.slots),
                    ("grpo_router_run_weight", "The run's fair-share weight", run.weight),
                    ("grpo_router_run_idle_seconds", "Seconds since the run's last request (its lease)", run.idle_s())):
                self.metrics.set(gauge, what, value, run=name)
