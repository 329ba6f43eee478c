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

import argparse
import importlib
import sys
from pathlib import Path


def _reproduce(argv) -> int:
    from .lab.runner import run_all

    ap = argparse.ArgumentParser(prog="grpo-lab reproduce",
                                 description="Execute the notebooks headless; what they measure goes to outputs/ "
                                             "(git-ignored) unless --refresh-results.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=True, help="CPU quick mode (default)")
    mode.add_argument("--full", action="store_true",
                      help="execute with the notebooks' own parameters (as committed they show the H200 results; "
                           "measuring needs RUN_HERE=True in a notebook and a GPU)")
    ap.add_argument("--notebooks", default="notebooks", help="folder of notebooks (default: notebooks/)")
    ap.add_argument("--only", nargs="*", default=None, help="run only notebooks whose name contains one of these")
    ap.add_argument("--executed-dir", default=None, help="where executed copies go (default: a temporary folder)")
    ap.add_argument("--stop-on-error", action="store_true")
    ap.add_argument("--refresh-results", action="store_true",
                    help="write the measured files into the committed results/ (maintainers refreshing them) "
                         "instead of outputs/")
    a = ap.parse_args(argv)
    if not Path(a.notebooks).is_dir():
        print(f"error: no notebooks folder {a.notebooks!r} (run from the repository root or pass --notebooks)",
              file=sys.stderr)
        return 2
    report = run_all(a.notebooks, executed_dir=a.executed_dir, quick=not a.full, only=a.only,
                     stop_on_error=a.stop_on_error, refresh_results=a.refresh_results)
    if not report:
        print("error: no notebooks found", file=sys.stderr)
        return 2
    bad = [r for r in report if r[1] != "ok"]
    print(f"{len(report) - len(bad)}/{len(report)} notebooks ok")
    for nb, status, _ in bad:
        print(f"FAILED {nb.name}: {status}", file=sys.stderr)
    return 1 if bad else 0


# each command's module, imported only when that command runs (they pull in torch, transformers, Jupyter, ...)
COMMANDS = {"reproduce": None, "memory": "grpo_lab.memory.sweep", "lab": "grpo_lab.lab.jupyter",
            "max-batch": "grpo_lab.memory.max_batch", "plan": "grpo_lab.memory.planner.cli",
            "async-loop": "grpo_lab.async_loop.command", "serve-pool": "grpo_lab.async_loop.serve_pool",
            "doctor": "grpo_lab.async_loop.doctor", "sweep": "grpo_lab.sweep.command"}


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
        command = _reproduce if COMMANDS[cmd] is None else importlib.import_module(COMMANDS[cmd]).main
        return int(command(rest) or 0)
    except (ValueError, OSError) as e:  # bad input, a path that is a file, a folder that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
