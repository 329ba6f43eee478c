"""What one caller sees of the router. The Router has one set of handlers (`router.server`) for every caller; where
callers differ, a handler asks the request's view: which adapters it sees and by what names, how many adapter slots
it has, whether and how it may complete, load, unload and pause, and which figures it reads: `PoolView` (a router
without tenancy), `AdminView` (a shared pool's admin) or `RunView` (one run of a shared pool).

A view reaches the router only through the object the router hands it (its pool, adapters, forwarder, pause
fan-out), never by import: tenancy sits below the router.
"""

from __future__ import annotations

from aiohttp import web

from ..wire.client_watch import client_closed_response
from ..wire.vllm_routes import error_response
from .runs import SEPARATOR, Run


def forbidden(message: str, param: str | None = None) -> web.Response:
    return error_response(403, message, "Forbidden", param=param)


def _namespaced(param: str = "lora_name") -> web.Response:
    """A name that would address a namespace (another run's, or its own by the replicas' name): refused."""
    return forbidden(f"names may not contain '{SEPARATOR}' on a shared pool (it separates a run from its adapters): "
                     "name your own adapters as you loaded them", param=param)


def _renamed(answer: web.Response, upstream: str, shown: str) -> web.Response:
    """A lifecycle answer with the run's own adapter name where it says the namespaced one."""
    return web.Response(body=answer.body.replace(upstream.encode(), shown.encode()), status=answer.status,
                        content_type=answer.content_type)


class PoolView:
    """The whole pool, as one client: adapters by the replicas' names, the replicas' own slots and pause."""

    run_name: str | None = None  # labels the completions' metrics
    slots: int | None = None  # the `max_loras` `/server_info` reports (None: the replicas' own)
    keep = None  # which metric series the caller reads (None: all)

    def __init__(self, router):
        self.router = router

    def owns(self, upstream: str) -> bool:
        return True

    def shown(self, upstream: str) -> str:
        """The caller's name for an adapter the replicas hold as `upstream`."""
        return upstream

    def completion(self, body: dict) -> tuple[dict, str | None] | web.Response:
        """The body to forward and the model name to answer with (None: as forwarded), or a refusal."""
        return body, None

    def gate(self, request: web.Request):
        """What a prompt waits for before it is forwarded (`Router.complete`'s `gate`): nothing."""
        return None

    def answered(self, answer: web.Response | None) -> web.Response:
        return client_closed_response() if answer is None else answer

    async def load(self, body: dict) -> web.Response:
        return await self.router.adapters.load(body)

    async def unload(self, body: dict) -> web.Response:
        return await self.router.adapters.unload(body)

    async def pause(self, pausing: bool, params) -> web.Response:
        return await self.router.pause_replicas(pausing, params)

    @property
    def paused(self) -> bool:
        return self.router.pool.paused

    def state(self, body: dict) -> dict:
        return body


VIEW = web.RequestKey("grpo_lab_view", PoolView)  # the view a request authenticated as (tenancy)


class AdminView(PoolView):
    """A shared pool's admin: the whole pool and every run, but no adapters of its own."""

    def __init__(self, api):
        super().__init__(api.router)
        self.api = api

    def completion(self, body: dict) -> web.Response:
        return forbidden("completions on a shared pool need a run's token (adapters belong to runs)")

    async def load(self, body: dict) -> web.Response:
        return forbidden("adapter loads on a shared pool need a run's token (adapters belong to runs)")

    async def unload(self, body: dict) -> web.Response:
        return forbidden("adapter unloads on a shared pool need a run's token (adapters belong to runs)")

    def state(self, body: dict) -> dict:
        api = self.api
        return {**body, "runs": {r.name: api.describe(r) for r in api.registry.runs.values()},
                "run_routing": self.router.forwarder.run_routing, "unloads": list(api.unloads)}


class RunView(PoolView):
    """One run of a shared pool (`run`), as a vLLM server holding only its adapters would answer."""

    def __init__(self, api, run: Run):
        super().__init__(api.router)
        self.api, self.run, self.run_name = api, run, run.name

    @property
    def slots(self) -> int:
        return self.run.slots  # what this run may hold: TRL checks it against max_staleness + 2

    def keep(self, labels: dict) -> bool:
        return labels.get("run", self.run.name) == self.run.name  # series of other runs are left out

    def owns(self, upstream: str) -> bool:
        return self.run.owns(upstream)

    def shown(self, upstream: str) -> str:
        return self.run.client_name(upstream)

    def completion(self, body: dict) -> tuple[dict, str | None] | web.Response:
        model = body.get("model")
        shown = model if isinstance(model, str) and model else None
        if shown is not None and SEPARATOR in shown:
            return _namespaced("model")
        if shown is not None and not self.router.pool.is_base_model(shown):
            return {**body, "model": self.run.upstream(shown)}, shown
        if not self.api.config.allow_base_model:
            return forbidden(f"runs on this pool may not use the base model{f' `{shown}`' if shown else ''}: name "
                             "one of your adapters", param="model")
        return body, shown

    def gate(self, request: web.Request):
        return lambda max_tokens, deadline: self.api.queued(self.run, request, max_tokens, deadline)

    def answered(self, answer: web.Response | None) -> web.Response:
        if answer is None:  # a dead client's completion renews nothing: its run's lease may lapse
            answer = client_closed_response()
        else:
            self.run.touch()
        self.api.metrics.inc("grpo_router_run_completions_total", "Completion requests of each run, by status",
                             run=self.run.name, status=str(answer.status))
        return answer

    async def load(self, body: dict) -> web.Response:
        run, api, adapters = self.run, self.api, self.router.adapters
        name = body.get("lora_name")
        if not isinstance(name, str) or not name or not isinstance(body.get("lora_path"), str):
            return await adapters.load(body)  # vLLM's own answers to a malformed body
        if SEPARATOR in name:
            return _namespaced()
        if self.router.pool.is_base_model(name):
            return error_response(400, f"The lora adapter '{name}' conflicts with a served base model.",
                                  "InvalidUserInput")
        upstream = run.upstream(name)
        refused = await api.make_room(run, upstream)
        if refused is not None:
            return refused
        run.loading.add(upstream)
        try:
            answer = await adapters.load({**body, "lora_name": upstream})
        finally:
            run.loading.discard(upstream)
        api.metrics.inc("grpo_router_run_adapter_loads_total", "Adapter loads of each run", run=run.name,
                        result="ok" if answer.status == 200 else "failed")
        if answer.status == 200 and api.registry.runs.get(run.name) is not run:  # removed while it loaded
            await api.unload(upstream, run, "lease", "the run was removed while this adapter loaded")
            return error_response(410, f"run '{run.name}' was removed while '{name}' loaded; it was unloaded again",
                                  "Gone")
        return _renamed(answer, upstream, name)

    async def unload(self, body: dict) -> web.Response:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return await self.router.adapters.unload(body)
        if SEPARATOR in name:
            return _namespaced()
        upstream = self.run.upstream(name)  # whatever it names, it is in this run's namespace: never another run's
        answer = await self.api.unload(upstream, self.run, "run", "unload requested by the run")
        return _renamed(answer, upstream, name)

    async def pause(self, pausing: bool, params) -> web.Response:
        """The run's own pause: its queued completions wait (a shared replica is not paused for one run, and an
        adapter-only sync does not need it: each rollout names its version)."""
        self.run.paused = pausing
        self.api.queue.set_paused(self.run.name, pausing)
        self.api.pool.save_state()
        return web.json_response({"status": "paused" if pausing else "resumed"})

    @property
    def paused(self) -> bool:
        return self.run.paused

    def state(self, body: dict) -> dict:
        """The router's state narrowed to the run: its adapters by its names, its completions per replica, its
        routing decisions and queue."""
        run, forwarder = self.run, self.router.forwarder
        mine = lambda names: sorted(run.client_name(n) for n in names if run.owns(n))
        replicas = [{**r, "adapters": mine(r["adapters"]), "draining": mine(r["draining"]),
                     "in_flight": forwarder.run_in_flight.get((run.name, r["index"]), 0)} for r in body["replicas"]]
        return {"run": self.api.describe(run), "replicas": replicas, "live_adapters": mine(body["live_adapters"]),
                "draining": {run.client_name(n): per for n, per in sorted(body["draining"].items()) if run.owns(n)},
                "paused": run.paused, "block_size": body["block_size"],
                "routing": dict(forwarder.run_routing.get(run.name, {"affinity": 0, "spilled": 0, "unmatched": 0}))}
