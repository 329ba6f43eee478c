"""`grpo-lab async-loop`: replicas + router + `AsyncGRPOLabTrainer` from a terminal, checked before anything starts.

    grpo-lab async-loop --max-steps 20 --output-dir runs/demo                 # offline: 2 CPU replicas + router
    grpo-lab async-loop --max-steps 40 --output-dir runs/demo --resume        # after a crash
    grpo-lab async-loop --replica-url http://node1:8001 --replica-url http://node2:8001   # replicas started elsewhere
    grpo-lab async-loop --router-url http://pool:8000 --run-name sweep-a --pool-admin-key-file runs/pool/admin.key
                                                                               # one run of a shared pool (serve-pool)

Every setting that can be checked without starting a process is checked first (`checks`): a bad one is one line on
stderr naming its flag, exit status 2, nothing started and nothing written. An output directory holds one run
(`run_dir`). On a terminal the run shows a progress bar with ETA and its key figures, and every run ends with the
doctor's verdict. A failure after the start is one line too (exit status 1; the replicas' logs are named);
`GRPO_LAB_DEBUG=1` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import signal
import sys
import time

from ..loss.backends import DEFAULT_LOSS_BACKEND, LOGPROB_BACKENDS
from ..serving.adapters.slots import DEFAULT_MAX_STALENESS
from .checks import (UsageError, check_model, check_pool, check_port, check_ray_address, check_server,
                     check_storage, check_vllm_python, check_writable_folder, cuda_available)
from .run_dir import RunDirError, check_output_dir
from .tree_attention import CHOICES as TREE_ATTENTION_CHOICES

PROG = "grpo-lab async-loop"
TRACKERS = ("trackio", "tensorboard", "wandb", "none")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each flag's default, except where there is none to show (None, a switch off)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or isinstance(action, argparse._AppendAction):
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (`grpo-lab async-loop: error: --flag: ...`), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(kind, low=None, low_open=False, allow=()):
    """An argparse type: a finite `kind` (int or float) >= low (> low when `low_open`), or one of `allow`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if value in allow:
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (value <= low if low_open else value < low):
            bound = f"> {low}" if low_open else f">= {low}"
            extra = f" (or {', '.join(map(str, allow))})" if allow else ""
            raise argparse.ArgumentTypeError(f"must be {bound}{extra}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, formatter_class=_DefaultsFormatter, description=(
        "Run TRL's AsyncGRPOTrainer with a LoRA adapter against inference replicas behind the grpo_lab router. "
        "Without --model it trains the embedded chat model on 2-digit addition, offline, on a CPU."))
    run = p.add_argument_group("the run")
    run.add_argument("--output-dir", default="runs/async-loop", help="folder of this run (checkpoints, metrics "
                     "log, run.json, replica logs); it must be new or empty unless --resume or --overwrite")
    run.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its last "
                     "complete checkpoint")
    run.add_argument("--overwrite", action="store_true", help="delete the run already in --output-dir and start "
                     "over")
    run.add_argument("--max-steps", type=_number(int, 1), default=20, help="optimizer steps (global, counting "
                     "the steps before a resume)")
    run.add_argument("--save-steps", type=_number(int, 1), default=10, help="checkpoint every this many steps")
    run.add_argument("--seed", type=_number(int, 0), default=0)
    run.add_argument("--run-name", default="loop", help="name of the run's results files (with --results-dir), and "
                     "its name on a shared pool (--router-url of `grpo-lab serve-pool`)")
    run.add_argument("--results-dir", default=None, help="also write <run-name>.csv and its doctor verdict here")

    task = p.add_argument_group("model and training")
    task.add_argument("--model", default=None, help="model directory, or a hub id when online (default: the "
                      "embedded chat model)")
    task.add_argument("--prompts-per-step", type=_number(int, 1), default=2)
    task.add_argument("--num-generations", type=_number(int, 2), default=8, help="rollouts per prompt (G)")
    task.add_argument("--learning-rate", type=_number(float, 0.0, low_open=True), default=3e-3)
    task.add_argument("--loss-backend", choices=LOGPROB_BACKENDS, default=DEFAULT_LOSS_BACKEND,
                      help="how the log-probs are computed (liger fuses its own loss and is not available here)")
    task.add_argument("--tree-attention", choices=TREE_ATTENTION_CHOICES, default="auto",
                      help="attention over packed prefix-trie rows")

    loop = p.add_argument_group("asynchrony")
    loop.add_argument("--max-staleness", type=_number(int, 0), default=DEFAULT_MAX_STALENESS,
                      help="how many policy versions old a sample may be when trained on")
    loop.add_argument("--max-inflight-tasks", type=_number(int, 1, allow=(-1,)), default=-1,
                      help="rollout requests in flight; -1 is TRL's default, max(max_staleness, 1) x samples per step")
    loop.add_argument("--autotune", action="store_true", help="let the run turn its requests in flight and queue "
                      "bound while it trains (grpo_lab.async_loop.autotune): each change is one line and an autotune/* "
                      "metric")
    loop.add_argument("--queue-maxsize", type=_number(int, 1), default=1024, help="scored samples the rollout "
                      "worker may queue ahead of the trainer (TRL's queue_maxsize)")
    run.add_argument("--report-to", action="append", choices=TRACKERS, default=None, metavar="TRACKER",
                     help=f"also log the run to a tracker, through transformers' integration (repeatable; one of "
                          f"{', '.join(TRACKERS)}; default none): trackio and tensorboard write locally")
    loop.add_argument("--no-group-versions", action="store_true", help="TRL's per-rollout policy versions instead "
                      "of one version per prompt group")
    loop.add_argument("--rollout-failure-timeout", type=_number(float, 0.0, low_open=True), default=120.0,
                      help="seconds of failing rollout requests before the run stops with an error")

    serve = p.add_argument_group("replicas and router")
    serve.add_argument("--replicas", type=_number(int, 1), default=2, help="replicas to start")
    serve.add_argument("--replica-kind", choices=("cpu", "vllm"), default="cpu",
                       help="cpu: grpo_lab's CPU replica; vllm: real vLLM (on a CPU: bash scripts/vllm_cpu_env.sh)")
    serve.add_argument("--replica-threads", type=_number(int, 1), default=1, help="torch threads per CPU replica")
    serve.add_argument("--replica-url", action="append", default=[], metavar="URL",
                       help="a replica started elsewhere (repeatable): start only the router, in front of these")
    serve.add_argument("--router-url", default=None, metavar="URL",
                       help="a router or vLLM server already running: start nothing")
    serve.add_argument("--port", type=_number(int, 0), default=0, help="the router's port (0: a free one)")
    serve.add_argument("--pool-admin-key-file", default=None, metavar="FILE",
                       help="with --router-url of a shared pool: the file `grpo-lab serve-pool` wrote its admin key "
                            "to (default: $GRPO_LAB_POOL_ADMIN_KEY_FILE, then $GRPO_LAB_POOL_ADMIN_KEY); the run "
                            "joins the pool as --run-name")
    serve.add_argument("--run-weight", type=_number(float, 0.0, low_open=True), default=1.0,
                       help="on a shared pool: this run's fair share of the replicas against the others' weights")
    serve.add_argument("--launcher", choices=("local", "ray"), default="local",
                       help="local: replicas are child processes of this command; ray: replica actors placed over a "
                            "Ray cluster's nodes and restarted by Ray (needs the `ray` extra)")
    serve.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="the Ray cluster for --launcher ray (auto, host:6379, ray://host:10001); default: start "
                            "a local one")
    serve.add_argument("--adapter-storage", default=None, metavar="PATH_OR_URL",
                       help="where adapter versions are published: a path or fsspec URL every replica can read "
                            "(default <output-dir>/.vllm_lora)")
    run.add_argument("--checkpoint-storage", default=None, metavar="URL",
                     help="also publish every complete checkpoint here (e.g. s3://bucket/run/checkpoints); --resume "
                          "on a fresh machine pulls the last complete one back")
    return p


def validate(a: argparse.Namespace) -> None:
    """Every check that needs no process started; raises UsageError / RunDirError naming the flag."""
    if a.router_url and a.replica_url:
        raise UsageError("--router-url", "give either --router-url (a running router) or --replica-url (replicas "
                                         "to route to), not both")
    if a.launcher == "ray":
        check_ray(a)
    elif a.ray_address:
        raise UsageError("--ray-address", "only means something with --launcher ray")
    if a.port > 65535:
        raise UsageError("--port", f"must be <= 65535, got {a.port}")
    if not a.run_name or os.sep in a.run_name or a.run_name.startswith("."):
        raise UsageError("--run-name", f"{a.run_name!r} is not a usable file name")
    check_output_dir(a.output_dir, a.resume, a.overwrite)
    a.resume_from = check_resume(a.output_dir, a.checkpoint_storage) if a.resume else None
    a.report_to = check_trackers(a.report_to)
    if a.results_dir:
        check_writable_folder("--results-dir", a.results_dir)
    if a.model is not None:
        check_model("--model", a.model)
    if a.adapter_storage:
        check_storage("--adapter-storage", a.adapter_storage)
    if a.checkpoint_storage:
        check_storage("--checkpoint-storage", a.checkpoint_storage)
    a.pool = None
    if a.router_url:
        a.pool = check_pool(a.router_url, a.pool_admin_key_file, a.run_name, a.max_staleness, a.resume, a.run_weight)
        if a.pool is None:
            check_server("--router-url", a.router_url)
    elif a.pool_admin_key_file:
        raise UsageError("--pool-admin-key-file", "joins a shared pool: give its --router-url")
    if a.run_weight != 1.0 and a.pool is None:
        raise UsageError("--run-weight", "is a run's share of a shared pool: give the pool's --router-url and "
                                         "--pool-admin-key-file")
    for url in a.replica_url:
        check_server("--replica-url", url)
    if not a.router_url:
        check_port("--port", a.port)
    if not a.router_url and not a.replica_url and a.replica_kind == "vllm" and not cuda_available():
        check_vllm_python("--replica-kind vllm")


def check_trackers(names: list[str] | None) -> list[str]:
    """`--report-to` as TRL's `report_to` list; a tracker whose package is missing is refused before anything starts."""
    names = [n for n in dict.fromkeys(names or []) if n != "none"]
    for name in names:
        if importlib.util.find_spec(name) is None:
            extra = "trackers" if name in ("trackio", "tensorboard") else name
            raise UsageError("--report-to", f"{name} is not installed: pip install 'grpo-lab[{extra}]'")
    return names


def check_ray(a: argparse.Namespace) -> None:
    if a.router_url or a.replica_url:
        raise UsageError("--launcher ray", "places the replicas the command starts: not with --router-url or "
                                           "--replica-url")
    if importlib.util.find_spec("ray") is None:
        raise UsageError("--launcher ray", "Ray is not installed: pip install 'grpo-lab[ray]'")
    check_ray_address("--ray-address", a.ray_address)


def check_resume(output_dir: str, checkpoint_storage: str | None = None) -> str | bool:
    """The checkpoint `--resume` starts from (incomplete ones a kill left are named on stderr and skipped), or True
    when the newest complete one is on `checkpoint_storage` (pulled once the checks passed: they write nothing)."""
    from .checkpoints import checkpoint_step, last_complete_checkpoint

    point = last_complete_checkpoint(output_dir)
    if point.skipped:
        print(f"--resume: skipping incomplete checkpoints: {point.describe_skipped()}", file=sys.stderr)
    if checkpoint_storage:
        from .checkpoint_store import CheckpointStore

        published = CheckpointStore(checkpoint_storage).published()
        local = checkpoint_step(point.checkpoint) if point.checkpoint else -1
        if published and checkpoint_step(published[0]) > local:
            return True
    if point.checkpoint is None:
        where = f" or on {checkpoint_storage}" if checkpoint_storage else ""
        raise UsageError("--resume", f"no complete checkpoint-* folder in {output_dir}{where}")
    return point.checkpoint


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["async-loop"]:
        argv = argv[1:]
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as stop:  # a refused argument (status 2, its one line printed) or --help (0)
        return int(stop.code or 0)
    try:
        validate(a)
    except (UsageError, RunDirError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    from .run import run_command  # heavy imports (torch, TRL) only once the settings are known to be good

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # the same teardown as Ctrl-C
    t0 = time.perf_counter()
    try:
        return run_command(a, t0, argv)
    except KeyboardInterrupt:
        print("interrupted: replicas, router and rollout worker stopped", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one line for the user; the traceback on request
        if os.environ.get("GRPO_LAB_DEBUG"):
            raise
        logs = os.path.join(os.path.abspath(a.output_dir), "logs")
        where = f" (replica logs: {logs})" if os.path.isdir(logs) else ""
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"{PROG}: error: {type(error).__name__}: {message}{where}; GRPO_LAB_DEBUG=1 shows the traceback",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
