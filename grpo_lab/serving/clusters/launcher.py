"""The one launcher of "replicas + a router in front": what to start (`ClusterSpec`), where the replicas run (a
placement), and one handle (`Cluster`: `start(timeout)`, `url`, `replica_urls`, `stop()`, a context manager).

    spec = ClusterSpec(replicas=2, kind="cpu", model="tiny-qwen3", max_staleness=4)
    with Cluster(spec, LocalProcesses()) as cluster:     # or RayActors(address="auto"), GivenReplicas([urls])
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)

Every caller (the async loop, the shared pool, `LocalCluster`, `RayCluster`) starts through here, so the replicas'
flags and the order are written once: replicas, then the router, then the placement's watch; `stop()` in reverse
(no restart reaches a stopped router), and a failed `start()` stops whatever it had started (docs/clusters.md).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from grpo_lab.lab.lifecycle import StartStop
from grpo_lab.lab.settings import Range, check_fields, setting

from ..adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for
from ..replicas.processes import restart, start_cpu_replicas, start_vllm_replicas
from ..router.config import RouterConfig
from ..router.process import SupervisedRouter
from ..router.thread import RouterHandle, start_router
from .ray_actor import ServerSpec
from .ray_logs import LogMirror
from .ray_replicas import RayReplicas

log = logging.getLogger(__name__)

REPLICA_KINDS = ("cpu", "vllm")
DEVICES = ("auto", "cuda", "cpu")


@dataclass
class ClusterSpec:
    """What to start: `replicas` replicas of one `kind` serving one `model`, and the router in front (`router`:
    `RouterConfig` fields, port 0 by default). `adapter_slots` overrides the `--max-loras` one run's `max_staleness`
    needs (a shared pool sums its runs' shares); `replica_args` / `vllm` are extra CPU-replica arguments /
    `VLLMReplicaSpec` fields; `device` "auto" is "cuda" where the placement has GPUs; `log_dir` also gets each
    replica's output (a Ray replica's copied back from its node, `ray_logs.LogMirror`)."""

    replicas: int = setting(2, check=Range(1))
    kind: Literal[REPLICA_KINDS] = "cpu"
    model: str = "tiny-qwen3"
    max_staleness: int = DEFAULT_MAX_STALENESS
    adapter_slots: int | None = None
    lora_rank: int = 16
    max_model_len: int | None = None
    replica_threads: int | None = None
    replica_args: list[str] = field(default_factory=list)
    vllm: dict = field(default_factory=dict)
    device: Literal[DEVICES] = "auto"
    env: dict = field(default_factory=dict)
    router: dict = field(default_factory=dict)
    log_dir: str | None = None

    def __post_init__(self):
        check_fields(self)

    @property
    def slots(self) -> int:
        """Each replica's `--max-loras`: one run's for `max_staleness`, unless `adapter_slots` says otherwise."""
        return self.adapter_slots if self.adapter_slots is not None else max_loras_for(self.max_staleness)

    def cpu_args(self) -> list[str]:
        """The CPU replica's arguments (without `--host`/`--port`: the placement sets them)."""
        optional = (("--max-model-len", self.max_model_len), ("--torch-threads", self.replica_threads))
        return ["--model", self.model, "--served-model-name", self.model, "trl-policy-v0",
                "--max-loras", str(self.slots), "--max-lora-rank", str(self.lora_rank),
                *[str(part) for flag, value in optional if value is not None for part in (flag, value)],
                *self.replica_args]

    def vllm_fields(self) -> dict:
        """`VLLMReplicaSpec` fields (without host, port, device, GPU or core: the placement sets them)."""
        return {"model": self.model, "lora_rank": self.lora_rank, "max_staleness": self.max_staleness,
                "max_loras": self.slots, "max_model_len": self.max_model_len, **self.vllm}


class Placement:
    """Where replicas run: `start(spec, timeout)` returns their URLs once they serve; `watch(router)` keeps the router
    in step with replicas that come and go; `replicas` is what it started, as it holds them."""

    replicas: object = ()

    @property
    def urls(self) -> list[str]:
        raise NotImplementedError

    def start(self, spec: ClusterSpec, timeout: float) -> list[str]:
        raise NotImplementedError

    def watch(self, router: RouterHandle) -> None:
        """Replicas here never change on their own: nothing to follow."""

    def unwatch(self) -> None:
        """Stop following (before the router stops)."""

    def stop(self) -> None:
        """Stop what `start` started; safe twice and after a failed start."""


class LocalProcesses(Placement):
    """Child processes of this one on loopback (`replicas.processes`), gone with this process even when SIGKILLed.

    Supervised, as Ray supervises its actors: `watch(router)` polls every replica process; one that exited is taken
    out of routing at once (`RouterHandle.replica_died`: no health check has to time out first) and restarted on the
    same port, up to `max_restarts` times each (0: never); the router's health watch re-admits it.
    `events` lists (time, "died" | "restarted" | "given up", url)."""

    def __init__(self, max_restarts: int = 3, poll_s: float = 0.1):
        self.replicas: list = []  # ReplicaProcess; kept after stop() so a caller can check they are gone
        self.max_restarts, self.poll_s = max_restarts, poll_s
        self.restarts: list[int] = []
        self.events: list[tuple[float, str, str]] = []
        self._given_up: set[int] = set()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self, spec: ClusterSpec, timeout: float) -> list[str]:
        env = spec.env or None
        if spec.kind == "cpu":
            self.replicas = start_cpu_replicas(spec.replicas, spec.cpu_args(), env, ready_timeout=timeout,
                                               log_dir=spec.log_dir)
        else:
            self.replicas = start_vllm_replicas(spec.replicas, device=_local_device(spec.device), env=env,
                                                ready_timeout=timeout, log_dir=spec.log_dir, **spec.vllm_fields())
        self.restarts = [0] * len(self.replicas)
        return self.urls

    def watch(self, router: RouterHandle) -> None:
        self._stop.clear()
        self._watcher = threading.Thread(target=self._supervise, args=(router,), name="local-replicas-watch",
                                         daemon=True)
        self._watcher.start()

    def _supervise(self, router: RouterHandle) -> None:
        while not self._stop.wait(self.poll_s):
            dead = [i for i, r in enumerate(self.replicas) if not r.alive() and i not in self._given_up]
            for i in dead:  # every dead one out of routing first: a restart takes seconds
                url, code = self.replicas[i].url, self.replicas[i].proc.returncode
                self.events.append((time.time(), "died", url))
                log.warning("replica %d at %s exited with %s: out of routing, restarting it", i, url, code)
                try:
                    router.replica_died(url, f"its process exited with {code}")
                except Exception as error:  # noqa: BLE001 - the router stopping under us; the restart goes on
                    log.warning("telling the router replica %d died: %s: %s", i, type(error).__name__, error)
            for i in dead:
                self._restart(i)

    def _restart(self, i: int) -> None:
        old = self.replicas[i]
        if self.restarts[i] >= self.max_restarts:
            self._given_up.add(i)
            self.events.append((time.time(), "given up", old.url))
            log.error("replica %d at %s died %d time(s): not restarted again (max_restarts=%d)", i, old.url,
                      self.restarts[i] + 1, self.max_restarts)
            return
        self.restarts[i] += 1
        try:
            fresh = restart(old)  # same port: the router knows it by its URL and re-admits it
        except Exception as error:  # noqa: BLE001 - tried again at the next poll, within max_restarts
            log.error("restarting replica %d at %s failed: %s", i, old.url, str(error).splitlines()[0])
            return
        if self._stop.is_set():  # stopped meanwhile: stop() may already have passed this one
            fresh.stop()
            return
        self.replicas[i] = fresh
        self.events.append((time.time(), "restarted", fresh.url))

    def unwatch(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=60)

    def stop(self) -> None:
        self.unwatch()
        for replica in self.replicas:
            replica.stop()


def _local_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # heavy: imported only to see whether this machine has a GPU for vLLM

    return "cuda" if torch.cuda.is_available() else "cpu"


class RayActors(Placement):
    """Replica actors over a Ray cluster's nodes (`ray_replicas.RayReplicas`): placed by one placement group, restarted
    by Ray, and the router told of each restart. `address` None joins the connected cluster or starts a local one;
    `host` None listens on each node's IP; `avoid_resource`: no replica on a node declaring it (the trainer's)."""

    def __init__(self, address: str | None = None, resources: dict | None = None, strategy: str = "SPREAD",
                 host: str | None = None, num_cpus: float = 1.0, max_restarts: int = 3,
                 avoid_resource: str | None = None):
        self.host = host
        self.options = dict(address=address, resources=dict(resources or {}), strategy=strategy, num_cpus=num_cpus,
                            max_restarts=max_restarts, avoid_resource=avoid_resource)  # `RayReplicas`' own
        self.replicas: RayReplicas | None = None
        self.log_dir: str | None = None
        self.mirror: LogMirror | None = None  # the replicas' output copied to `log_dir` while watched

    @property
    def urls(self) -> list[str]:
        return self.replicas.urls if self.replicas is not None else []

    def start(self, spec: ClusterSpec, timeout: float) -> list[str]:
        self.log_dir = spec.log_dir
        what = {"cpu_args": spec.cpu_args()} if spec.kind == "cpu" else {"vllm": spec.vllm_fields()}
        server = ServerSpec(spec.kind, env=dict(spec.env), host=self.host, ready_timeout_s=timeout, **what)
        self.replicas = RayReplicas(spec.replicas, server, ready_timeout_s=timeout, **self.options)
        if spec.kind == "vllm":  # a GPU per replica when the cluster has them (the trainer's machine may have none)
            gpus = self.replicas.connect().cluster_resources().get("GPU", 0) if spec.device == "auto" else 0
            server.device = "cuda" if spec.device == "cuda" or gpus >= 1 else "cpu"
            self.replicas.num_gpus = 1.0 if server.device == "cuda" else 0.0
        return self.replicas.start().urls

    def watch(self, router: RouterHandle) -> None:
        self.replicas.watch(router)
        if self.log_dir:
            self.mirror = LogMirror(self.replicas, self.log_dir).start()

    def unwatch(self) -> None:
        if self.mirror is not None:  # a last copy while the replicas still serve
            self.mirror.stop()
            self.mirror = None
        if self.replicas is not None:
            self.replicas.unwatch()

    def stop(self) -> None:
        if self.replicas is not None:
            self.replicas.stop()


class GivenReplicas(Placement):
    """Replicas started elsewhere (other hosts, other jobs): only the router is started, in front of `urls`."""

    def __init__(self, urls: list[str]):
        self.replicas = list(urls)

    @property
    def urls(self) -> list[str]:
        return list(self.replicas)

    def start(self, spec: ClusterSpec, timeout: float) -> list[str]:
        return self.urls


class Cluster(StartStop):
    """The replicas `spec` describes, placed by `placement` (default: local child processes), and a router in front
    of them: on a thread of this process, or with `router_dir` a supervised child process (`router.process`),
    restarted on the same port when it dies, its state file, config and log in `router_dir`."""

    def __init__(self, spec: ClusterSpec, placement: Placement | None = None, router_dir: str | None = None):
        self.spec = spec
        self.placement = placement if placement is not None else LocalProcesses()
        self.router_dir = router_dir
        self.router: RouterHandle | SupervisedRouter | None = None

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def replicas(self):
        """What the placement holds: the replica processes, the `RayReplicas`, or the given URLs."""
        return self.placement.replicas

    @property
    def replica_urls(self) -> list[str]:
        return self.placement.urls

    def start(self, timeout: float = 120.0) -> Cluster:
        try:
            urls = self.placement.start(self.spec, timeout)
            config = RouterConfig(replicas=urls, **{"port": 0, **self.spec.router})
            if self.router_dir is None:
                self.router = start_router(config)
            else:  # a restarted router starts with the replicas the placement has then (Ray may have moved one)
                self.router = SupervisedRouter(config, self.router_dir, members=lambda: self.placement.urls,
                                               ready_timeout_s=timeout).start()
            self.router.wait_ready(timeout=timeout)
            self.placement.watch(self.router)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.placement.unwatch()
        if self.router is not None:
            self.router.stop()
        self.placement.stop()
