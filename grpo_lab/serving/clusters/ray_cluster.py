"""Replicas on a Ray cluster and a router in this process, in one call: the Ray counterpart of `LocalCluster`.

    with RayCluster(replicas=2, model="/models/Qwen2.5-Math-1.5B", kind="vllm", address="auto") as cluster:
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)
"""

from __future__ import annotations

from ..adapters.slots import DEFAULT_MAX_STALENESS
from .launcher import Cluster, ClusterSpec, RayActors


class RayCluster(Cluster):
    """`launcher.Cluster` with `RayActors`: the replica fields are `ClusterSpec`'s, the placement ones `RayActors`'."""

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

    def start(self, timeout: float = 600.0) -> RayCluster:  # Ray schedules and loads models slower: a longer default
        return super().start(timeout)
