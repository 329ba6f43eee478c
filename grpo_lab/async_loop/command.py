"""`grpo-lab async-loop`: replicas + router + `AsyncGRPOLabTrainer` from a terminal, checked before anything starts.

Examples: the top of docs/async_loop.md. The flags are generated from `loop_settings.LoopSettings`. Every
setting that can be checked without starting a process is checked first (`checks`): a bad one is one line
naming its flag, exit status 2, nothing started or written. A failure after the start is one line too (exit
status 1, the replicas' logs named); `GRPO_LAB_DEBUG=1` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..lab.install import install_hint
from .checks import (UsageError, check_model, check_pool, check_pool_name, check_port, check_ray_address,
                     check_server, check_storage, check_vllm_python, check_writable_folder, cuda_available,
                     failed, read_pool)
from .pool import pool_name

if TYPE_CHECKING:  # annotations only: the module imports it late (see below)
    from .loop_settings import LoopSettings

# The settings, their parser and the run folder's rules import torch, transformers and TRL (~20 s on a busy 2-core
# machine): they are imported in the functions below, after `ask_the_pool_first` had its quick answer.

PROG = "grpo-lab async-loop"


def build_parser():
    """The command line, generated from `LoopSettings` (each field one flag, its default and rule there)."""
    from .loop_settings import LoopSettings
    from .settings_parser import SettingsParser

    return SettingsParser(LoopSettings, PROG, description=(
        "Run TRL's AsyncGRPOTrainer with a LoRA adapter against inference replicas behind the grpo_lab router. "
        "Without --model it trains the embedded chat model on 2-digit addition, offline, on a CPU."))


def parse_settings(argv: list[str]) -> LoopSettings:
    """The settings `argv` gives (SystemExit for a refused flag or --help; UsageError for a refused value)."""
    return build_parser().parse(argv)


@dataclass
class Checked:
    """What the checks found out: the checkpoint a resume starts from (True: the newest is on
    --checkpoint-storage), and the shared pool's `/router/runs` answer (None: the run joins no pool)."""

    resume_from: str | bool | None = None
    pool: dict | None = None


def validate(s: LoopSettings) -> Checked:
    """Every check that needs no process started (the settings' own rules ran when they were made); raises
    UsageError / RunDirError naming the flag."""
    from .loop_settings import LoopSettings
    from .run_dir import check_output_dir

    if s.launcher == "ray" and importlib.util.find_spec("ray") is None:
        raise UsageError("--launcher ray", f"Ray is not installed: {install_hint('ray')}")
    if s.launcher == "ray":
        check_ray_address("--ray-address", s.ray_address)
    check_output_dir(s.output_dir, s.resume, s.overwrite)
    if s.checkpoint_storage:  # before --resume reads the store
        check_storage("--checkpoint-storage", s.checkpoint_storage)
    found = Checked(resume_from=check_resume(s.output_dir, s.checkpoint_storage) if s.resume else None)
    check_trackers(s.trackers)
    if s.results_dir:
        check_writable_folder("--results-dir", s.results_dir)
    if s.model is not None:
        check_model("--model", s.model)
    if s.adapter_storage:
        check_storage("--adapter-storage", s.adapter_storage)
    if s.router_url:
        name, flag = pool_name(s.run_name, s.pool_run)
        found.pool = check_pool(s.router_url, s.pool_admin_key_file, name, s.max_staleness, s.resume, s.run_weight,
                                name_flag=flag)
    elif s.pool_admin_key_file:
        raise UsageError("--pool-admin-key-file", "joins a shared pool: give its --router-url")
    for flag, given in (("--run-weight", s.run_weight != LoopSettings.run_weight), ("--pool-run", s.pool_run)):
        if given and found.pool is None:
            raise UsageError(flag, "is about a run on a shared pool: give the pool's --router-url and "
                                   "--pool-admin-key-file")
    if s.router_url and found.pool is None:
        check_server("--router-url", s.router_url)
    for url in s.replica_url:
        check_server("--replica-url", url)
    if not s.router_url:
        check_port("--port", s.port)
    if s.starts_replicas and s.replica_kind == "vllm" and not cuda_available():
        check_vllm_python("--replica-kind vllm")
    return found


def check_trackers(names: list[str]) -> None:
    """A tracker of `--report-to` whose package is missing is refused before anything starts."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            how = install_hint("trackers") if name in ("trackio", "tensorboard") else f"pip install {name}"  # no extra
            raise UsageError("--report-to", f"{name} is not installed: {how}")


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


def ask_the_pool_first(argv: list[str]) -> None:
    """Refuse a run name already on a shared pool (or a pool that does not answer or refuses the key) before the
    settings' slow imports: the refusal used to come ~20 s after the command started, all of it importing torch,
    transformers and TRL for the parser. Only the pool flags are read here; with `--config` (which may set them) or
    `--help` nothing is asked, and `validate` asks again with every setting known."""
    if any(a in ("-h", "--help") or a.split("=", 1)[0] == "--config" for a in argv):
        return
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in ("--router-url", "--pool-admin-key-file", "--run-name", "--pool-run"):
        parser.add_argument(flag)
    parser.add_argument("--resume", action="store_true")
    try:
        flags, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:  # anything odd is left to the full parser
        return
    if not flags.router_url:
        return
    pool = read_pool(flags.router_url, flags.pool_admin_key_file)
    if pool is not None:
        name, flag = pool_name(flags.run_name, flags.pool_run)
        check_pool_name(pool, flags.router_url, name, flags.resume, flag)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ask_the_pool_first(argv)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    from .run_dir import REPLICA_LOGS, RunDirError  # heavy (transformers): after the pool's quick answer

    try:
        s = parse_settings(argv)
        found = validate(s)
    except SystemExit as stop:  # a refused argument (status 2, its one line printed) or --help (0)
        return int(stop.code or 0)
    except (UsageError, RunDirError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    from .run import run_command  # heavy imports (torch, TRL) only once the settings are known to be good

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt: the teardown of Ctrl-C
    t0 = time.perf_counter()
    try:
        return run_command(s, found, t0, argv)
    except KeyboardInterrupt:
        print("interrupted: replicas, router and rollout worker stopped", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one line for the user; the traceback on request
        return failed(PROG, error, os.path.join(s.output_dir, REPLICA_LOGS))


if __name__ == "__main__":
    sys.exit(main())
