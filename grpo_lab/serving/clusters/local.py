"""N CPU replicas and a router on loopback in one call, for notebooks and quick experiments.

    with LocalCluster(replicas=2) as cluster:
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)
"""

from __future__ import annotations

from ..adapters.slots import DEFAULT_MAX_STALENESS
from .launcher import Cluster, ClusterSpec, LocalProcesses


class LocalCluster(Cluster):
    """`launcher.Cluster` with CPU replica subprocesses, under the arguments notebooks and tests use; no restarts by
    default (`max_restarts`): they kill and restart replicas by hand."""

    def __init__(self, replicas: int = 2, model: str = "tiny-qwen3", max_staleness: int = DEFAULT_MAX_STALENESS,
                 max_lora_rank: int = 16, replica_args: list[str] | None = None, env: dict | None = None,
                 router: dict | None = None, log_dir: str | None = None, adapter_slots: int | None = None,
                 max_restarts: int = 0):
        super().__init__(ClusterSpec(replicas=replicas, kind="cpu", model=model, max_staleness=max_staleness,
                                     adapter_slots=adapter_slots, lora_rank=max_lora_rank,
                                     replica_args=list(replica_args or []), env=dict(env or {}),
                                     router=dict(router or {}), log_dir=log_dir),
                         LocalProcesses(max_restarts=max_restarts))

    @property
    def args(self) -> list[str]:
        return self.spec.cpu_args()
