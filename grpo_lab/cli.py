"""The `grpo-lab` command.

    grpo-lab lab                          open the notebooks in JupyterLab on this environment (127.0.0.1 only)
    grpo-lab reproduce --quick            execute every notebook under notebooks/ headless (CPU quick mode) → outputs/
                                          (--refresh-results: rewrite the committed results/ instead)
    grpo-lab memory --quick|--full ...    peak memory vs batch size (python -m grpo_lab.memory.sweep)
    grpo-lab max-batch --quick|--full ... FSDP2 + LoRA max-batch search (python -m grpo_lab.memory.max_batch)
    grpo-lab plan --model M --gpus N --gib G ...  predicted peak memory and max batch (grpo_lab.memory.planner)
    grpo-lab async-loop [--max-steps N] ... async LoRA GRPO: replicas + router + AsyncGRPOTrainer (--resume after a crash)
    grpo-lab serve-pool [--replicas N]    replicas + a router that several async-loop runs share (--router-url URL
                                          --run-name NAME joins it); prints the URL and where the admin key is
    grpo-lab sweep GRID.yaml [--max-steps N]  the runs of a YAML grid of async-loop settings as tenants of one pool,
                                          a line per run as it goes, the runs ranked by final reward at the end
    grpo-lab doctor RUN_DIR               which side of a (running) async loop waits, and the knob to turn (judged by
                                          the run's own run.json; flags override)

Bad input (unknown model or backend, batch sizes that are not positive integers) is reported as one line on stderr
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import importlib
import sys


# each command's module, imported only when that command runs (they pull in torch, transformers, Jupyter, ...)
COMMANDS = {"reproduce": "grpo_lab.lab.runner", "memory": "grpo_lab.memory.sweep",
            "lab": "grpo_lab.lab.jupyter", "max-batch": "grpo_lab.memory.max_batch",
            "plan": "grpo_lab.memory.planner.cli", "async-loop": "grpo_lab.async_loop.command",
            "serve-pool": "grpo_lab.async_loop.serve_pool", "doctor": "grpo_lab.async_loop.doctor",
            "sweep": "grpo_lab.sweep.command"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}; use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(COMMANDS[cmd]).main(rest) or 0)
    except (ValueError, OSError) as e:  # bad input, a path that is a file, a folder that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
