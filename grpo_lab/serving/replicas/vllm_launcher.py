"""Print (or exec) the command lines of real vLLM replicas for adapter-only async GRPO, and the router's line.

What each flag is for is in `vllm_spec`; on a CPU without `--python` the vllm-cpu venv is used.

    python -m grpo_lab.serving.replicas.vllm_launcher --model Qwen/Qwen2.5-Math-1.5B --lora-rank 1 --max-staleness 4 \\
        --replicas 2 --base-port 8001          # prints one command per GPU; add --exec to run a single one
    python -m grpo_lab.serving.replicas.vllm_launcher --device cpu --model /path/to/model --replicas 2
"""

from __future__ import annotations

import argparse
import os

from .processes import vllm_cpu_python
from .vllm_spec import VLLMReplicaSpec, replica_specs


def router_command(specs: list[VLLMReplicaSpec], port: int = 8000) -> str:
    replicas = " ".join(f"--replica {s.url}" for s in specs)
    return f"python -m grpo_lab.serving.router.server {replicas} --port {port}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m grpo_lab.serving.replicas.vllm_launcher",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--python", default=None,
                   help="interpreter with vLLM (on a CPU: the vllm-cpu venv's, see scripts/vllm_cpu_env.sh)")
    p.add_argument("--lora-rank", type=int, default=VLLMReplicaSpec.lora_rank)  # the spec's defaults
    p.add_argument("--max-staleness", type=int, default=VLLMReplicaSpec.max_staleness)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--base-port", type=int, default=8001)
    p.add_argument("--router-port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: 4096 on GPUs, the model's own on a CPU)")
    p.add_argument("--exec", action="store_true", help="exec the command of replica 0 instead of printing")
    args, extra = p.parse_known_args(argv)
    kwargs = dict(lora_rank=args.lora_rank, max_staleness=args.max_staleness, python=args.python,
                  extra_args=tuple(extra))
    if args.max_model_len is not None:  # else VLLMReplicaSpec's default (a CPU replica: the model's own)
        kwargs["max_model_len"] = args.max_model_len
    try:
        if args.device == "cpu" and args.python is None:
            kwargs["python"] = vllm_cpu_python()
        specs = replica_specs(args.model, args.replicas, args.base_port, device=args.device, **kwargs)
    except (ValueError, FileNotFoundError) as error:
        p.exit(2, f"error: {error}\n")
    if args.exec:
        cmd = specs[0].command()
        os.execvpe(cmd[0], cmd, specs[0].env())
    for s in specs:
        print(s.shell_line() + " &")
    print(router_command(specs, args.router_port))


if __name__ == "__main__":
    main()
