"""The router's replicas: health checks, taking failed ones out of routing, and re-admitting them safely
(docs/serving.md, "Watches replicas").

The published proxy kept routing to dead replicas (they looked least loaded); here a replica is routed to only while
it is *in service*, and comes back only when healthy, consistent with the others, holding exactly the live adapters,
paused if the others are, and with its prefix ownership cleared. A replica that joins (`membership`) is admitted the
same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ..adapters.drain import set_within
from ..adapters.fanout import broadcast, load_one, unload_one
from ..routing.policy import RoutingPolicy
from ..routing.registry import make_policy
from ..wire.metrics import Registry
from .config import RouterConfig
from .state_file import load_state, write_state
from ..wire.upstream import (DOWN, IN_SERVICE, INCONSISTENT, REMOVED, STARTING, STATES, TRANSPORT_ERRORS, Replica,
                       UpstreamClient, now)

log = logging.getLogger(__name__)

# Fields of `vllm_config` that must agree across replicas for the router to pass as one server.
CONSISTENT_FIELDS = (
    ("model_config", "model"), ("model_config", "max_model_len"), ("model_config", "dtype"),
    ("cache_config", "block_size"), ("lora_config", "max_lora_rank"), ("lora_config", "max_loras"),
)


def _field(info: dict, section: str, key: str):
    part = info.get(section)
    return part.get(key) if isinstance(part, dict) else None


class ReplicaPool:
    """The replicas, their health and admission, and the routing `policy` that spreads completions over them
    (default: a new one of the kind `config.routing_policy` names)."""

    def __init__(self, config: RouterConfig, client: UpstreamClient, metrics: Registry,
                 policy: RoutingPolicy | None = None):
        self.config = config
        self.client = client
        self.metrics = metrics
        self.replicas: list[Replica] = []  # the membership, in the order replicas joined
        self._slots: dict[int, Replica] = {}  # replica number -> replica (members, and removed ones until reused)
        self.policy = policy or make_policy(config.routing_policy, max(1, len(config.replicas)), config.routing)
        self._watchers: dict[int, asyncio.Task] = {}
        self._stop: asyncio.Event | None = None  # set while the health checks run
        for url in config.replicas:
            self.join(url)
        # a router restarted after a crash takes the live set and pause state it wrote (`state_file`), not the first
        # replica's adapters (a drained one would be adopted as live and hold a slot for good)
        self.state_file = config.state_file
        saved = load_state(self.state_file) if self.state_file else None
        self.restored = saved is not None
        saved = saved or {"live_adapters": {}, "paused": False, "runs": []}
        self.live_adapters: dict[str, str] = saved["live_adapters"]  # loaded on every in-service replica
        self._paused: bool = saved["paused"]
        self.saved_runs: list[dict] = saved["runs"]  # for the tenancy to take back
        self.runs_state: Callable[[], list[dict]] | None = None  # the tenancy's runs, written with the rest
        self.resumed_at = 0.0  # monotonic time of the last resume: per-try deadlines do not count a pause
        self.reference_info: dict | None = None
        self.control_lock = asyncio.Lock()  # admissions, load commits, unload bookkeeping and pause/resume
        self._name_locks: dict[str, list] = {}  # adapter name -> [lock, users]: loads/unloads of one name in order
        self.slot_freed = asyncio.Event()  # set (and replaced) whenever an adapter leaves a replica
        self.load_limits = dict(deadline_s=config.load_retry_deadline_s, interval_s=config.load_retry_interval_s,
                                timeout_s=config.control_timeout_s)  # how each replica's adapter load is retried

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if self._paused and not value:
            self.resumed_at = now()
        self._paused = value
        self.save_state()

    def save_state(self) -> None:
        """Write the live adapters and the pause state for a restarted router (`state_file`), if it has a file."""
        if self.state_file:
            write_state(self.state_file, self.live_adapters, self._paused,
                        self.runs_state() if self.runs_state is not None else None)

    def by_index(self, index: int) -> Replica:
        return self._slots[index]

    def member(self, url: str) -> Replica | None:
        return next((r for r in self.replicas if r.url == url), None)

    # -- membership ----------------------------------------------------------------------------------------------
    def join(self, url: str) -> Replica:
        """Add a replica: it starts out of routing and is admitted by its health watch like a restarted one (healthy,
        consistent, holding every live adapter). Its number is the lowest one free: never used, or left by a removed
        replica with nothing in flight any more (so the policy's bitmasks stay as wide as the largest membership)."""
        index = next((i for i, r in self._slots.items() if r.state == REMOVED and not r.tries and not r.calls
                      and self.policy.in_flight[i] == 0), len(self._slots))
        if index in self._slots:
            self.policy.forget_replica(index)  # whatever the removed replica with this number left behind
        self.policy.ensure_replicas(index + 1)
        replica = Replica(index, url)
        self._slots[index] = replica
        self.replicas.append(replica)
        if self._stop is not None:
            self._start_watch(replica)
        self.publish_states()
        return replica

    def leave(self, replica: Replica, reason: str) -> None:
        """Take a replica out of the membership for good. Completions still running there go on (`membership`
        decides how long); no new one is sent, its health watch ends, its prefix ownership is forgotten and its
        gauges are dropped."""
        if replica.state == REMOVED:
            return
        self.replicas.remove(replica)
        replica.state, replica.last_error = REMOVED, reason
        watcher = self._watchers.pop(replica.index, None)
        if watcher is not None:
            watcher.cancel()
        if replica.draining:
            replica.draining.clear()
            self.notify_slot_freed()
        self.policy.forget_replica(replica.index)
        self.metrics.drop_gauges(replica=replica.url)
        log.info("replica %s removed: %s", replica.url, reason)

    # -- state ---------------------------------------------------------------------------------------------------
    def in_service(self) -> list[Replica]:
        return [r for r in self.replicas if r.serving]

    def candidates(self, model: str) -> list[Replica]:
        return [r for r in self.replicas if r.serving and r.has_model(model)]

    def known_model(self, model: str) -> bool:
        return model in self.live_adapters or self.is_base_model(model)

    def is_base_model(self, model: str) -> bool:
        return any(model in r.base_models for r in self.replicas)

    @property
    def max_model_len(self) -> int | None:
        value = _field(self.reference_info or {}, "model_config", "max_model_len")
        return value if isinstance(value, int) else None

    @contextlib.asynccontextmanager
    async def name_lock(self, name: str):
        """Loads and unloads of one adapter name run one at a time; different names run side by side (as vLLM's
        per-name lock), so one slow load never blocks the others."""
        entry = self._name_locks.setdefault(name, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                self._name_locks.pop(name, None)

    def notify_slot_freed(self) -> None:
        self.slot_freed.set()
        self.slot_freed = asyncio.Event()

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.state in (DOWN, REMOVED):
            return
        log.warning("replica %s out of routing: %s", replica.url, self.client.scrub(reason))
        replica.state, replica.last_error = DOWN, self.client.scrub(reason)
        self.metrics.inc("grpo_router_replica_failures_total", "Replicas taken out of routing", replica=replica.url)
        self.publish_states()
        replica.cut_calls()  # its completions in flight are re-sent elsewhere instead of waiting for it
        if replica.draining:
            replica.draining.clear()  # re-admission unloads what is not live
            self.notify_slot_freed()

    def publish_states(self) -> None:
        for r in self.replicas:
            for state in STATES:
                self.metrics.set("grpo_router_replica_state", "1 for the replica's current state", int(r.state == state),
                                 replica=r.url, state=state)

    # -- probing and admission --------------------------------------------------------------------------------
    async def _fetch_info(self, replica: Replica) -> tuple[dict, dict]:
        timeout = self.config.health_timeout_s
        reply = await self.client.call(replica, "GET", "/server_info", params={"config_format": "json"},
                                       timeout=timeout)
        if reply.status == 401:
            raise ValueError("replica answered 401: the bearer token is missing or wrong (set the same VLLM_API_KEY "
                             "for the router and the replicas)")
        if reply.status == 404:
            raise ValueError("replica has no /server_info: start vLLM with VLLM_SERVER_DEV_MODE=1")
        info = reply.json()
        models = (await self.client.call(replica, "GET", "/v1/models", timeout=timeout)).json()
        if not isinstance(info, dict) or "vllm_config" not in info or not isinstance(models, dict):
            raise ValueError("replica answered /server_info or /v1/models without the vLLM shape")
        return info["vllm_config"], models

    def _inconsistency(self, info: dict) -> str | None:
        parallel = info.get("parallel_config") or {}
        if parallel.get("data_parallel_size", 1) != 1:
            return ("replica reports data_parallel_size > 1: adapter loads would reach only one of its engines; "
                    "run one replica per engine behind the router")
        if self.reference_info is None:
            return None
        for section, key in CONSISTENT_FIELDS:
            mine, ref = _field(info, section, key), _field(self.reference_info, section, key)
            if mine != ref:
                return f"{section}.{key} is {mine!r} here but {ref!r} on the other replicas"
        return None

    async def try_admit(self, replica: Replica) -> bool:
        """Bring a healthy replica into service (under the control lock). False if not (yet) possible."""
        async with self.control_lock:
            if replica.serving:
                return True
            try:
                info, models = await self._fetch_info(replica)
            except (*TRANSPORT_ERRORS, ValueError) as error:
                replica.last_error = self.client.scrub(f"{type(error).__name__}: {error}")
                return False
            problem = self._inconsistency(info)
            if problem:
                if replica.state != INCONSISTENT:
                    log.error("replica %s not admitted: %s", replica.url, problem)
                replica.state, replica.last_error = INCONSISTENT, problem
                self.publish_states()
                return False
            entries = models.get("data", [])
            replica.base_models = {e["id"] for e in entries if not e.get("parent")}
            present = {e["id"]: e.get("root") for e in entries if e.get("parent")}
            first = self.reference_info is None
            if first:
                self.reference_info = info
                self._adopt_block_size(info)
            ok = await self._sync_adapters(replica, present, adopt=first and not self.live_adapters
                                           and not self.restored)
            if ok and self.paused:
                ok = await self._pause(replica)
            if not ok or replica.state == REMOVED:
                return False
            max_loras = _field(info, "lora_config", "max_loras")
            replica.max_loras = max_loras if isinstance(max_loras, int) and max_loras > 0 else None
            self.policy.forget_replica(replica.index)
            if replica.state != STARTING:
                self.metrics.inc("grpo_router_readmissions_total", "Replicas re-admitted after a failure",
                                 replica=replica.url)
            replica.epoch += 1
            replica.state, replica.last_error = IN_SERVICE, ""
            log.info("replica %s in service (%d live adapters)", replica.url, len(self.live_adapters))
            self.publish_states()
            return True

    async def _pause(self, replica: Replica) -> bool:
        """Pause a replica joining while the others are paused."""
        (outcome,) = await broadcast(self.client, [replica], "POST", "/pause", params={"mode": "keep"},
                                     timeout_s=self.config.control_timeout_s)
        if not outcome.ok:
            replica.last_error = self.client.scrub(f"/pause failed: {outcome.status} {outcome.message}")
        return outcome.ok

    def _adopt_block_size(self, info: dict) -> None:
        block = _field(info, "cache_config", "block_size")
        if isinstance(block, int) and block > 0 and block != self.policy.config.block_size:
            log.info("using the replicas' KV block size %d for prefix hashing", block)
            self.policy.config.block_size = block

    async def _sync_adapters(self, replica: Replica, present: dict[str, str], adopt: bool) -> bool:
        """Make the replica hold exactly the live adapters. The first replica seen donates its set instead."""
        if adopt:
            self.live_adapters.update(present)
            self.save_state()
        # a name being loaded right now is left alone: that load either commits it or rolls it back here
        for name in [n for n in present if n not in self.live_adapters and n not in replica.transitioning]:
            outcome = await unload_one(self.client, replica, name, self.config.control_timeout_s)
            if not outcome.ok:
                replica.last_error = f"could not unload stale adapter {name}: {outcome.message}"
                return False
        replica.adapters = {}
        for name, path in self.live_adapters.items():
            if (present.get(name) or "").rstrip("/") != path.rstrip("/"):  # not held there from the same path
                outcome = await load_one(self.client, replica, name, path, **self.load_limits)
                self.count_retries(outcome)
                if not outcome.ok:
                    replica.last_error = (f"could not load live adapter {name}: {outcome.status} "
                                          f"{outcome.message}")
                    log.warning("replica %s not re-admitted: %s", replica.url, replica.last_error)
                    return False
            replica.adapters[name] = path
        return True

    def count_retries(self, outcome) -> None:
        """Count a load's retries on "No adapter found" (shared storage not visible there yet)."""
        if outcome.retries:
            self.metrics.inc("grpo_router_adapter_load_retries_total", "Load retries on 'No adapter found'",
                             outcome.retries, replica=outcome.replica.url)

    # -- background health --------------------------------------------------------------------------------------
    async def check(self, replica: Replica) -> None:
        healthy = await self.client.healthy(replica, self.config.health_timeout_s)
        if replica.serving:
            if not healthy:
                self.mark_down(replica, f"health check failed (refused, or no 200 within {self.config.health_timeout_s}s)")
            else:
                await self._check_adapters(replica)
        elif healthy:
            await self.try_admit(replica)

    async def _check_adapters(self, replica: Replica) -> None:
        """Take a replica out whose adapters are not what the router confirmed there: restarted between two health
        checks (healthy, but its adapters are gone), or holding one the router does not know (an unload there
        failed, or a load rolled back raced it), which uses up a `max_loras` slot. Names loaded or unloaded there
        while the answer was produced are not compared. Re-admission then makes it hold exactly the live adapters."""
        seq, were = replica.transition_seq, set(replica.transitioning)
        before = dict(replica.adapters)
        try:
            reply = await self.client.call(replica, "GET", "/v1/models", timeout=self.config.health_timeout_s)
        except TRANSPORT_ERRORS:
            self.mark_down(replica, "/v1/models failed")
            return
        moving = replica.transitions_since(seq, were)
        if moving is None or not replica.serving:
            return  # too much happened meanwhile to compare; the next check will
        body = reply.json()
        entries = body.get("data") if isinstance(body, dict) else None
        if reply.status != 200 or not isinstance(entries, list):
            self.mark_down(replica, f"/v1/models answered {reply.status} without the vLLM shape")
            return
        entries = [e for e in entries if isinstance(e, dict)]
        names = {e.get("id") for e in entries}
        confirmed = {n for n in before if n in replica.adapters} - moving
        known = set(before) | set(replica.adapters) | moving | set(self.live_adapters)
        missing = sorted(n for n in confirmed if n not in names)
        extra = sorted(str(e.get("id")) for e in entries if e.get("parent") and e.get("id") not in known)
        if missing:
            self.mark_down(replica, f"lost adapter(s) {missing} the router had loaded there (restarted?)")
        elif extra:
            self.mark_down(replica, f"holds adapter(s) {extra} that are not live (a failed unload?); "
                                    "re-admission unloads them")

    async def run_health_checks(self, stop: asyncio.Event) -> None:
        """One loop per replica, so a re-admission waiting for a long adapter load never delays the others' checks;
        replicas that join later get theirs when they join."""
        self._stop = stop
        for replica in self.replicas:
            self._start_watch(replica)
        try:
            await stop.wait()
        finally:
            watchers = list(self._watchers.values())
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    def _start_watch(self, replica: Replica) -> None:
        self._watchers[replica.index] = asyncio.get_running_loop().create_task(self._watch(replica, self._stop))

    async def _watch(self, replica: Replica, stop: asyncio.Event) -> None:
        while not stop.is_set() and replica.state != REMOVED:
            try:
                await self.check(replica)
            except Exception as error:  # a bug in one check must not end the watch
                log.exception("health check of %s failed: %s", replica.url, self.client.scrub(str(error)))
            await set_within(stop, self.config.health_interval_s)
