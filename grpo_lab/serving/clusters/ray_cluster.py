"""Replicas on a Ray cluster and a router in this process, in one call: the one launcher (`launcher.Cluster`) with
Ray actors, under the name and arguments of the Ray counterpart of `LocalCluster`.

    with RayCluster(replicas=2, model="/models/Qwen2.5-Math-1.5B", kind="vllm", address="auto") as cluster:
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)

Ray restarts a replica that dies, and the router follows (`ray_replicas.watch`): a restarted replica is routed to
only once it holds every live adapter. `cluster.replicas` is the `RayReplicas` (`infos()`, `urls`).
"""

from __future__ import annotations

from ..adapters.slots import DEFAULT_MAX_STALENESS
from .launcher import Cluster, ClusterSpec, RayActors


class RayCluster(Cluster):
    """`replicas` replica actors on Ray (`kind` "cpu" or "vllm") and an in-process router in front of them.

    Args:
        replicas, model, kind, device, max_staleness, lora_rank, max_model_len, replica_args, vllm, env, router: as
            in `launcher.ClusterSpec`.
        address, host, resources, strategy, num_cpus, max_restarts: where and how Ray places them (`RayActors`).
    """

    def __init__(self, replicas: int = 2, model: str = "tiny-qwen3", kind: str = "cpu", device: str = "auto",
                 max_staleness: int = DEFAULT_MAX_STALENESS, lora_rank: int = 16, max_model_len: int | None = None,
                 replica_args: list[str] | None = None, vllm: dict | None = None, env: dict | None = None,
                 router: dict | None = None, address: str | None = None, host: str | None = None,
                 resources: dict | None = None, strategy: str = "SPREAD", num_cpus: float = 1.0,
                 max_restarts: int = 3):
        spec = ClusterSpec(replicas=replicas, kind=kind, model=model, device=device, max_staleness=max_staleness,
                           lora_rank=lora_rank, max_model_len=max_model_len, replica_args=list(replica_args or []),
                           vllm=dict(vllm or {}), env=dict(env or {}), router=dict(router or {}))
        super().__init__(spec, RayActors(address=address, resources=resources, strategy=strategy, host=host,
                                         num_cpus=num_cpus, max_restarts=max_restarts))

    def start(self, timeout: float = 600.0) -> RayCluster:
        return super().start(timeout)
