"""N CPU replicas and a router on loopback in one call, for notebooks and quick experiments.

    with LocalCluster(replicas=2) as cluster:
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)
"""

from __future__ import annotations

from .launcher import Cluster, ClusterSpec, LocalProcesses


class LocalCluster(Cluster):
    """`launcher.Cluster` with CPU replica subprocesses: `ClusterSpec`'s fields (the LoRA rank as
    `max_lora_rank`, the CPU replica's flag); no restarts by default (`max_restarts`): notebooks and tests
    kill and restart replicas by hand."""

    def __init__(self, max_lora_rank: int = ClusterSpec.lora_rank, max_restarts: int = 0, **fields):
        super().__init__(ClusterSpec(kind="cpu", lora_rank=max_lora_rank, **fields),
                         LocalProcesses(max_restarts=max_restarts))

    @property
    def args(self) -> list[str]:
        return self.spec.cpu_args()
