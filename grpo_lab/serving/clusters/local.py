"""N CPU replicas and a router on loopback in one call, for notebooks and quick experiments.

    with LocalCluster(replicas=2) as cluster:
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)
"""

from __future__ import annotations

from ..adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for
from ..replicas.processes import CPUReplicaProcess, start_cpu_replicas
from ..router.config import RouterConfig
from ..router.thread import RouterHandle, start_router


class LocalCluster:
    """Start `replicas` CPU replica subprocesses (`python -m grpo_lab.serving.replicas.cpu_replica`) and an in-process router.

    Args:
        replicas: how many CPU replicas.
        model: the replicas' model (a `grpo_lab.models` name or a local directory).
        max_staleness: the trainer's `max_staleness`; sets `--max-loras` (`adapter_slots.max_loras_for`: TRL's
            minimum and one slot more, so the version it unloads can drain while the next one loads).
        max_lora_rank: the replicas' `--max-lora-rank`.
        replica_args: extra `cpu_replica` arguments.
        env: extra environment for the replicas (e.g. `{"VLLM_API_KEY": token}`).
        router: keyword arguments for `RouterConfig` (port defaults to 0, a free port).
        log_dir: where each replica's output also goes (`replica-<i>.log`); None keeps it in memory only.
        adapter_slots: the replicas' `--max-loras` when it is not one run's: a pool shared by runs
            (`RouterConfig.tenancy`) needs the sum of their shares (`max_loras_for(max_staleness)` each).
    """

    def __init__(self, replicas: int = 2, model: str = "tiny-qwen3", max_staleness: int = DEFAULT_MAX_STALENESS,
                 max_lora_rank: int = 16, replica_args: list[str] | None = None, env: dict | None = None,
                 router: dict | None = None, log_dir: str | None = None, adapter_slots: int | None = None):
        slots = adapter_slots if adapter_slots is not None else max_loras_for(max_staleness)
        self.args = ["--model", model, "--served-model-name", model, "trl-policy-v0",
                     "--max-loras", str(slots), "--max-lora-rank", str(max_lora_rank),
                     *(replica_args or [])]
        self.n, self.env, self.router_kwargs = replicas, env, {"port": 0, **(router or {})}
        self.log_dir = log_dir
        self.replicas: list[CPUReplicaProcess] = []
        self.router: RouterHandle | None = None

    @property
    def url(self) -> str:
        return self.router.url

    def start(self, timeout: float = 120.0) -> "LocalCluster":
        self.replicas = start_cpu_replicas(self.n, self.args, self.env, ready_timeout=timeout, log_dir=self.log_dir)
        try:
            self.router = start_router(RouterConfig(replicas=[r.url for r in self.replicas], **self.router_kwargs))
            self.router.wait_ready(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for r in self.replicas:
            r.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_servers(cluster: LocalCluster | None, router: RouterHandle | None, vllm_replicas) -> None:
    """Stop what an async loop or a shared pool started, whichever of them it holds: the local cluster (its router
    and CPU replicas), a router started in front of vLLM replicas, then those replicas."""
    if cluster is not None:
        cluster.stop()
    if router is not None:
        router.stop()
    for replica in vllm_replicas:
        replica.stop()
