"""Replicas on a Ray cluster and a router in this process, in one call: the Ray counterpart of `LocalCluster`.

    with RayCluster(replicas=2, model="/models/Qwen2.5-Math-1.5B", kind="vllm", address="auto") as cluster:
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)
"""

from __future__ import annotations

import inspect

from .launcher import Cluster, ClusterSpec, RayActors

PLACEMENT_FIELDS = tuple(inspect.signature(RayActors).parameters)  # address, resources, strategy, host, ...


class RayCluster(Cluster):
    """`launcher.Cluster` with `RayActors`: `RayActors`' arguments go to the placement, the others are
    `ClusterSpec`'s fields."""

    def __init__(self, **fields):
        placement = {name: fields.pop(name) for name in PLACEMENT_FIELDS if name in fields}
        super().__init__(ClusterSpec(**fields), RayActors(**placement))

    def start(self, timeout: float = 600.0) -> RayCluster:  # Ray schedules and loads models slower: a longer default
        return super().start(timeout)
