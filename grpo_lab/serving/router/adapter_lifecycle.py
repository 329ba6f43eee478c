"""The router's adapter lifecycle: loading a policy version on every replica in service, unloading it after a drain
(docs/serving.md, "Loads adapters all-or-nothing" and "Drains unloads").

Behind the router TRL's load and unload reach several replicas, and the router must answer each as one vLLM server
would. The live set is `ReplicaPool.live_adapters`, which re-admission reloads on a returning replica.
"""

from __future__ import annotations

import logging

from aiohttp import web

from ..adapters.drain import Drainer
from ..adapters.fanout import Outcome, load_everywhere, load_one
from ..wire.metrics import Registry
from .replica_pool import ReplicaPool
from .config import RouterConfig, adapter_path_error
from ..wire.upstream import UpstreamClient
from ..wire.vllm_routes import error_response

log = logging.getLogger(__name__)


class AdapterLifecycle:
    """Loads and unloads of adapters across a `ReplicaPool`; the router hands it the parsed JSON bodies."""

    def __init__(self, pool: ReplicaPool, client: UpstreamClient, config: RouterConfig, metrics: Registry):
        self.pool, self.client, self.config, self.metrics = pool, client, config, metrics
        self.drainer = Drainer(pool)

    async def load(self, body: dict) -> web.Response:
        """`POST /v1/load_lora_adapter` with the JSON `body`: all or nothing across the replicas in service, after
        the drain of an earlier unload of the same name and (bounded) for a slot held by a draining adapter."""
        name, path = body.get("lora_name"), body.get("lora_path")
        for field in ("lora_name", "lora_path"):  # what vLLM's request schema refuses, as it reports it
            if not isinstance(body.get(field), str):
                message = "Field required" if field not in body else "Input should be a valid string"
                return error_response(400, message, "Bad Request", param=f"body.{field}")
        if not name or not path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if body.get("load_inplace"):
            return error_response(400, "load_inplace is not supported by the router (a reload could not be made "
                                  "atomic across replicas): publish each policy under a new name",
                                  param="load_inplace")
        pool = self.pool
        if pool.is_base_model(name):
            return error_response(400, f"The lora adapter '{name}' conflicts with a served base model.",
                                  "InvalidUserInput")
        problem = adapter_path_error(path, self.config.adapter_roots)
        if problem:
            return error_response(400, problem, param="lora_path")
        async with pool.name_lock(name):
            if name in pool.live_adapters:
                return error_response(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                      "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            wait_s = self.config.unload_drain_timeout_s + self.config.control_timeout_s
            if not await self.drainer.wait_done(name, wait_s):
                return error_response(503, f"adapter '{name}' is still being unloaded (draining) after "
                                      f"{wait_s:.0f}s", "ServiceUnavailable")
            targets = pool.in_service()
            if targets:  # a slot a drain holds: wait for it (bounded, not while paused)
                await self.drainer.wait_for_slots(targets, self.config.unload_drain_timeout_s)
                targets = pool.in_service()
            if not targets:
                return error_response(503, "no replica in service to load the adapter on", "ServiceUnavailable")
            ok, outcomes = await self._load_everywhere(targets, name, path)
            full = [o.replica for o in outcomes if not o.ok and o.status == 400 and o.replica.draining]
            if not ok and full and len(full) == sum(not o.ok for o in outcomes):
                # every refusal came from a replica whose slots drains still hold (its completions frozen by the
                # pause, or queued behind a dead replica's re-sent ones): end those drains there and load again
                await self.drainer.make_room(full)
                ok, outcomes = await self._load_everywhere(pool.in_service(), name, path)
            self._count_load(outcomes, ok)
            if not ok:
                return self._load_failed(name, path, outcomes)
            async with pool.control_lock:
                await self._load_on_late_replicas(name, path)
                pool.live_adapters[name] = path
                pool.save_state()
            log.info("adapter %s loaded on %d replica(s)", name, len(targets))
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _load_everywhere(self, targets, name: str, path: str) -> tuple[bool, list[Outcome]]:
        """All or nothing on `targets`; re-admission unloads what a failed rollback left (`on_stale`)."""
        return await load_everywhere(self.client, targets, name, path, on_stale=self.pool.mark_down,
                                     **self.pool.load_limits)

    def _count_load(self, outcomes: list[Outcome], ok: bool) -> None:
        for o in outcomes:
            self.pool.count_retries(o)
            if o.transport_error:
                self.pool.mark_down(o.replica, f"adapter load failed: {o.message}")
        self.metrics.inc("grpo_router_adapter_loads_total", "Adapter loads, all-or-nothing across replicas",
                         result="ok" if ok else "failed")

    async def _load_on_late_replicas(self, name: str, path: str) -> None:
        """Replicas admitted while the load ran (they synced the live set, which did not have it yet) load it now;
        one that cannot leaves routing and gets it at re-admission."""
        for replica in [r for r in self.pool.in_service() if name not in r.adapters]:
            outcome = await load_one(self.client, replica, name, path, **self.pool.load_limits)
            if outcome.ok:
                replica.adapters[name] = path
            else:
                self.pool.mark_down(replica, f"could not load adapter {name} after joining: {outcome.message}")

    def _load_failed(self, name: str, path: str, outcomes: list[Outcome]) -> web.Response:
        """The failed load's error; it names the replicas whose rollback failed (now out of routing)."""
        bad = [o for o in outcomes if not o.ok]
        rolled = sum(1 for o in outcomes if o.ok and o.newly_loaded and not o.left_loaded)
        stale = [o.replica.url for o in outcomes if o.left_loaded]
        tail = f"rolled back on {rolled} replica(s)"
        if stale:
            tail += (f"; the rollback failed on {', '.join(stale)} (out of routing until re-admission unloads "
                     "it there), so no replica in service serves it")
        else:
            tail += ", so no replica serves it"
        if all(o.no_adapter for o in bad):
            # vLLM answers 404 at once; after the storage-lag retries the router answers 400, because TRL's client
            # reads any 404 from this endpoint as "runtime LoRA updating is off" and drops the message.
            waited = max(o.elapsed_s for o in bad)
            message = (f"Loading lora {name} failed: No adapter found for {path} on "
                       f"{', '.join(o.replica.url for o in bad)} (still missing after {waited:.1f}s of retries, "
                       f"load_retry_deadline_s={self.config.load_retry_deadline_s:g}: is the path on storage every "
                       f"replica mounts?); {tail}")
            log.warning(message)
            return error_response(400, message, "NotFoundError", param="lora_path")
        first = bad[0]
        message = f"loading adapter '{name}' failed on {first.replica.url}: {first.status} {first.message}; {tail}"
        log.warning(message)
        return error_response(first.status if 400 <= first.status < 600 else 502, message, "AdapterLoadError")

    async def unload(self, body: dict) -> web.Response:
        """`POST /v1/unload_lora_adapter`, answered at once: new completions naming the adapter get 404 from now on;
        each replica unloads it once its completions using it have finished (`adapters.drain`)."""
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return error_response(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                                  "InvalidUserInput")
        pool = self.pool
        async with pool.name_lock(name):
            if name not in pool.live_adapters:
                return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            async with pool.control_lock:
                pool.live_adapters.pop(name)
                pool.save_state()
                self.drainer.start(name, [r for r in pool.replicas if r.serving and name in r.adapters])
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def close(self) -> None:
        """Stop the drains still running (the router is shutting down)."""
        await self.drainer.close()
