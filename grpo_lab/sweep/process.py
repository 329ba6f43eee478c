"""One sweep run as a child process: `python -m grpo_lab.cli async-loop --config <its settings file>`, in a session
of its own (its rollout worker with it), so it can be stopped alone while the other runs go on.

The settings go through the command's own `--config` (the `LoopSettings` field names as keys, read by the
generated parser), so no flag is written here; the file stays in the sweep's folder as the run's exact settings.
A stop is the command's own graceful end first (SIGTERM: it stops its rollout worker and leaves the pool, which
unloads its adapters), then SIGKILL to its whole process group after a bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ..lab import environment
from ..lab.files import write_atomically

COMMAND = [sys.executable, "-m", "grpo_lab.cli", "async-loop"]


def write_settings(path: Path, settings: dict) -> Path:
    """The run's settings as the `--config` file of `grpo-lab async-loop`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, yaml.safe_dump(settings, sort_keys=False))
    return path


def launch(settings_file: Path, log_file: Path, env: dict | None = None) -> subprocess.Popen:
    """Start the run; its output (progress lines, the doctor's verdict, a failure's one line) goes to `log_file`.
    The sweep's own pool token, if any, is not inherited: the run registers and gets its own."""
    child_env = {**os.environ, **(env or {})}
    child_env.pop(environment.RUN_TOKEN, None)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        return subprocess.Popen([*COMMAND, "--config", str(settings_file)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=child_env)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the run's process group (the command, its rollout worker, anything they started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc: subprocess.Popen, timeout_s: float) -> int:
    """End the run: SIGTERM (the command's graceful teardown), SIGKILL to its group after `timeout_s`; then
    whatever is left of its group is killed too. Returns its exit status."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait(timeout=30)
    reap_group(proc)
    return proc.returncode


def reap_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Once the command exited, its children (the rollout worker exits with it) get `grace_s`, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_alive(proc.pid):
        kill_group(proc)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group `pgid` is still there (zombies of this process aside)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
