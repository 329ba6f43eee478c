"""Replicas placed by Ray across the nodes of a cluster, restarted by Ray when they die, and kept in step with the
router.

    from grpo_lab.serving.clusters.ray_replicas import RayReplicas
    from grpo_lab.serving.clusters.ray_actor import ServerSpec

    with RayReplicas(2, ServerSpec("vllm", vllm={"model": "Qwen/Qwen2.5-Math-1.5B"}), num_gpus=1,
                     address="auto") as replicas:
        router = start_router(RouterConfig(replicas=replicas.urls, port=8000))
        replicas.watch(router)                      # restarts reach the router (remove + add)
        ...

Each replica is a `ray_actor.ReplicaServer` actor in its own bundle of one placement group; Ray restarts a dead one
and `watch(router)` swaps it in the router. Placement, restarts and teardown in detail: docs/clusters.md.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass

from ...lab.install import install_hint
from ...lab.lifecycle import StartStop
from .ray_actor import ReplicaServer, ServerSpec
from .ray_placement import placement_options

log = logging.getLogger(__name__)

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


@dataclass
class _Slot:
    """One replica as the launcher tracks it."""

    index: int
    actor: object
    info: dict | None = None  # the last answer of the actor's current incarnation
    routed: str | None = None  # the URL the router has for this slot (None: removed, waiting for a restart)
    pending: object = None  # an info() call not answered yet
    asked_at: float = 0.0
    restarts: int = 0


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"the Ray launcher needs Ray: {install_hint('ray')}") from None
    return ray


class RayReplicas(StartStop):
    """`n` replica actors of `spec` (`ray_actor.ServerSpec`), placed by a placement group; `start()`, `urls`,
    `watch(router)`, `stop()`. `address` None joins the connected cluster or starts a local one (disconnected at
    `stop()`); `max_restarts` -1: without limit; `watch` polls every `poll_s` and removes an actor silent for
    `unavailable_s`; `avoid_resource`: no replica on a node declaring it (`ray_placement`).
    """

    def __init__(self, n: int, spec: ServerSpec, address: str | None = None, num_cpus: float = 1.0,
                 num_gpus: float = 0.0, resources: dict | None = None, strategy: str = "SPREAD",
                 max_restarts: int = 3, poll_s: float = 0.5, unavailable_s: float = 2.0,
                 ready_timeout_s: float = 600.0, avoid_resource: str | None = None):
        if n < 1:
            raise ValueError("n must be >= 1")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.n, self.spec, self.address = n, spec, address
        self.num_cpus, self.num_gpus, self.resources = num_cpus, num_gpus, dict(resources or {})
        self.strategy, self.max_restarts = strategy, max_restarts
        self.avoid_resource = avoid_resource
        self.poll_s, self.unavailable_s, self.ready_timeout_s = poll_s, unavailable_s, ready_timeout_s
        self.slots: list[_Slot] = []
        self.placement_group = None
        self.router = None
        self.events: list[tuple[float, str, str]] = []  # (time, what, url): restarts seen, for logs and tests
        self._connected_here = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- start ---------------------------------------------------------------------------------------------------
    def _bundle(self) -> dict:
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        return bundle

    def connect(self):
        """Ray, connected to `address` (a connection made here is closed at `stop()`)."""
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            self._connected_here = True
        return ray

    def start(self) -> RayReplicas:
        """Place the bundles, start every actor, wait until each server serves. Everything started is stopped if
        any of it fails."""
        ray = self.connect()
        from ray.util.placement_group import placement_group  # Ray is optional: the `ray` extra
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        try:
            where = placement_options(ray, self._bundle(), self.n, self.strategy, self.avoid_resource)
            self.placement_group = placement_group([self._bundle()] * self.n, strategy=self.strategy, **where,
                                                   name=f"grpo-lab-replicas-{id(self):x}")
            try:
                ray.get(self.placement_group.ready(), timeout=self.ready_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"Ray could not place {self.n} replica(s) of {self._bundle()} with {self.strategy} "
                                   f"within {self.ready_timeout_s:.0f}s: {ray.available_resources()} available "
                                   "(STRICT_SPREAD needs one node per replica; custom resources must be declared "
                                   "with `ray start --resources`)") from None
            actor_class = ray.remote(ReplicaServer)
            for i in range(self.n):
                actor = actor_class.options(
                    num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources or None,
                    max_restarts=self.max_restarts, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                         placement_group_bundle_index=i),
                ).remote(self.spec, i)
                self.slots.append(_Slot(i, actor))
            infos = ray.get([s.actor.info.remote() for s in self.slots], timeout=self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        for slot, info in zip(self.slots, infos):
            slot.info, slot.routed = info, info["url"]
        log.info("%d replica(s) on Ray: %s", self.n, ", ".join(f"{i['url']} (node {i['node_ip']})" for i in infos))
        return self

    @property
    def urls(self) -> list[str]:
        """The replicas' URLs now (a replica being restarted is left out)."""
        return [info["url"] for info in self.infos() if info is not None]

    def infos(self) -> list[dict | None]:
        """Each replica's last `ReplicaServer.info()` (node, pids, incarnation), None while it restarts."""
        with self._lock:
            return [dict(s.info) if s.info is not None and s.routed is not None else None for s in self.slots]

    # -- keeping the router in step ---------------------------------------------------------------------------
    def watch(self, router) -> RayReplicas:
        """Keep `router` (a `RouterHandle` of this process or a `RouterAdminClient`) in step with restarts, from a
        daemon thread, until `stop()`."""
        self.router = router
        self._watcher = threading.Thread(target=self._watch, name="ray-replicas-watch", daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            for slot in self.slots:
                try:
                    self._check(slot)
                except Exception as error:  # a failed router call must not end the watch
                    log.warning("watching replica %d: %s: %s", slot.index, type(error).__name__, error)

    def _check(self, slot: _Slot) -> None:
        ray = _ray()
        if slot.pending is None:
            slot.pending, slot.asked_at = slot.actor.info.remote(), time.monotonic()
        ready, _ = ray.wait([slot.pending], timeout=0)
        if not ready:  # dead, restarting, or its new server still starting
            if slot.routed is not None and time.monotonic() - slot.asked_at > self.unavailable_s:
                self._unroute(slot, "stopped answering")
            return
        ref, slot.pending = slot.pending, None
        try:
            info = ray.get(ref)
        except ray.exceptions.RayActorError:  # it died with the call in flight; Ray restarts it (max_restarts)
            if slot.routed is not None:
                self._unroute(slot, "died")
            return
        same = slot.info is not None and info["incarnation"] == slot.info["incarnation"]
        if same and slot.routed is not None:
            return
        if not same and slot.routed is not None:
            self._unroute(slot, "restarted")
        with self._lock:
            slot.info, slot.restarts = info, slot.restarts + (not same)
        self.router.add_replica(info["url"])  # admitted once it holds every live adapter
        with self._lock:
            slot.routed = info["url"]
        self.events.append((time.time(), "added", info["url"]))
        log.warning("replica %d is back at %s (%s)", slot.index, info["url"],
                    "it was only slow to answer" if same else f"restart {slot.restarts}")

    def _unroute(self, slot: _Slot, why: str) -> None:
        url = slot.routed
        with self._lock:
            slot.routed = None
        self.router.remove_replica(url, drain_s=0)  # its completions are re-sent to the others
        self.events.append((time.time(), "removed", url))
        log.warning("replica %d at %s %s: removed from the router until Ray restarts it", slot.index, url, why)

    def unwatch(self) -> None:
        """End the watch (before the router it drives stops)."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=10)

    # -- teardown ------------------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every server and actor and remove the placement group; safe to call twice, and after a failed
        start."""
        self.unwatch()
        ray = sys.modules.get("ray")  # never imported: nothing was started
        if ray is None or not ray.is_initialized():
            return
        stops = []
        for slot in self.slots:
            with contextlib.suppress(Exception):  # already dead
                stops.append(slot.actor.stop.remote())
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        for slot in self.slots:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(slot.actor, no_restart=True)
        self.slots = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # the cluster went away
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._connected_here:
            ray.shutdown()
            self._connected_here = False
