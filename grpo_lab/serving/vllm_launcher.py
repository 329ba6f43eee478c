"""Build the `vllm serve` command line and environment a real GPU replica needs for adapter-only async GRPO.

TRL 1.16's AsyncGRPOTrainer syncs a PEFT policy as LoRA adapters only when the server was started with
`--enable-lora`, a `--max-lora-rank` at least the adapter's rank (rounded up to a rank vLLM accepts) and
`--max-loras >= max_staleness + 2` (DESIGN.md §4); runtime loading needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, and
`/pause` and `/server_info` need `VLLM_SERVER_DEV_MODE=1`. `--logprobs-mode processed_logprobs` makes the returned
logprobs match the temperature-scaled ones TRL's importance-sampling correction assumes. The first rollouts name
`trl-policy-v0` before any sync, so that name is served as an alias of the base model.

    python -m grpo_lab.serving.vllm_launcher --model Qwen/Qwen2.5-Math-1.5B --lora-rank 1 --max-staleness 4 \\
        --replicas 2 --base-port 8001          # prints one command per GPU; add --exec to run a single one
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass

from .replica_config import VLLM_LORA_RANKS


def round_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that is >= `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})")


@dataclass
class VLLMReplicaSpec:
    """One `vllm serve` replica for adapter-only async GRPO.

    Args:
        model: hub id or local path of the base model.
        lora_rank: the adapter's LoRA rank r.
        max_staleness: the trainer's `max_staleness`; sets `--max-loras`.
        port, host: where the replica listens (keep it on loopback behind the router).
        gpu: CUDA device index for `CUDA_VISIBLE_DEVICES`; None leaves it alone.
        max_model_len: context length; None lets vLLM read it from the model.
        gpu_memory_utilization: fraction of GPU memory vLLM may take.
        served_model_aliases: extra names for the base model ("trl-policy-v0" for the pre-sync rollouts).
        api_key_env: if set in the launcher's environment, passed to vLLM as `--api-key` via VLLM_API_KEY.
        extra_args: appended as-is.
    """

    model: str
    lora_rank: int = 1
    max_staleness: int = 4
    port: int = 8001
    host: str = "127.0.0.1"
    gpu: int | None = None
    max_model_len: int | None = 4096
    gpu_memory_utilization: float = 0.9
    served_model_aliases: tuple[str, ...] = ("trl-policy-v0",)
    api_key_env: str = "VLLM_API_KEY"
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        round_lora_rank(self.lora_rank)

    def command(self) -> list[str]:
        cmd = ["vllm", "serve", self.model, "--host", self.host, "--port", str(self.port),
               "--served-model-name", self.model, *self.served_model_aliases,
               "--enable-lora", "--max-lora-rank", str(round_lora_rank(self.lora_rank)),
               "--max-loras", str(self.max_staleness + 2),
               "--enable-prefix-caching", "--data-parallel-size", "1",
               "--logprobs-mode", "processed_logprobs",
               "--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd + list(self.extra_args)

    def env(self, base: dict | None = None) -> dict:
        """The environment to run `command()` in. vLLM reads its bearer token from VLLM_API_KEY itself, so the
        token never appears on a command line (where `ps` would show it)."""
        env = dict(os.environ if base is None else base)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        token = env.get(self.api_key_env)
        if token and self.api_key_env != "VLLM_API_KEY":
            env["VLLM_API_KEY"] = token
        return env

    def shell_line(self) -> str:
        """A copy-pasteable line; names the env flags but never the token."""
        prefix = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_SERVER_DEV_MODE=1"
        if self.gpu is not None:
            prefix += f" CUDA_VISIBLE_DEVICES={self.gpu}"
        return f"{prefix} {shlex.join(self.command())}"


def replica_specs(model: str, replicas: int, base_port: int = 8001, **kwargs) -> list[VLLMReplicaSpec]:
    """One spec per GPU: replica i on GPU i, port base_port + i."""
    return [VLLMReplicaSpec(model=model, port=base_port + i, gpu=i, **kwargs) for i in range(replicas)]


def router_command(specs: list[VLLMReplicaSpec], port: int = 8000) -> str:
    replicas = " ".join(f"--replica http://{s.host}:{s.port}" for s in specs)
    return f"python -m grpo_lab.serving.router {replicas} --port {port}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m grpo_lab.serving.vllm_launcher", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--lora-rank", type=int, default=1)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--base-port", type=int, default=8001)
    p.add_argument("--router-port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--exec", action="store_true", help="exec the command of replica 0 instead of printing")
    args, extra = p.parse_known_args(argv)
    specs = replica_specs(args.model, args.replicas, args.base_port, lora_rank=args.lora_rank,
                          max_staleness=args.max_staleness, max_model_len=args.max_model_len,
                          extra_args=tuple(extra))
    if args.exec:
        cmd = specs[0].command()
        os.execvpe(cmd[0], cmd, specs[0].env())
    for s in specs:
        print(s.shell_line() + " &")
    print(router_command(specs, args.router_port))


if __name__ == "__main__":
    main()
