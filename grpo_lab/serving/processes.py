"""Start CPU replicas as real subprocesses on loopback and wait for them, for tests, notebooks and benchmarks."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time


class ReplicaProcess:
    """A `python -m grpo_lab.serving.cpu_replica` child; `url` is known once it printed `READY <port>`."""

    def __init__(self, args: list[str], env: dict | None = None, ready_timeout: float = 120.0,
                 log_path: str | os.PathLike | None = None):
        self.args = list(args)
        self.port: int | None = None
        self.output: list[str] = []  # everything the child printed (stdout and stderr)
        # and a copy on disk when asked: a loop that fails on a replica's 500 can only be diagnosed from its traceback
        self.log_path = log_path
        self._log = open(log_path, "a", buffering=1) if log_path is not None else None
        cmd = [sys.executable, "-u", "-m", "grpo_lab.serving.cpu_replica", "--exit-with-parent", *self.args]
        # its own process group (kill() takes its children too), and a stdin pipe it watches: if this process
        # dies without stopping it, the pipe closes and the replica exits instead of lingering
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})}, start_new_session=True)
        ready: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(ready,), daemon=True)
        self._reader.start()
        self.ready_timeout = ready_timeout
        self._ready = ready

    def _read(self, ready: queue.Queue) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            if self._log is not None:
                self._log.write(line)
            if line.startswith("READY "):
                ready.put(int(line.split()[1]))
        if self._log is not None:
            self._log.close()
        ready.put(None)

    def wait_ready(self) -> "ReplicaProcess":
        try:
            port = self._ready.get(timeout=self.ready_timeout)
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"CPU replica not ready in {self.ready_timeout}s:\n{''.join(self.output[-20:])}")
        if port is None:
            raise RuntimeError(f"CPU replica exited with {self.proc.poll()}:\n{''.join(self.output[-20:])}")
        self.port = port
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def start_cpu_replicas(n: int, args: list[str] | None = None, env: dict | None = None,
                       ready_timeout: float = 120.0, log_dir: str | os.PathLike | None = None) -> list[ReplicaProcess]:
    """Start `n` replicas in parallel (each with `--port 0`) and wait until all are listening; with `log_dir`, each
    one's output also goes to `log_dir/replica-<i>.log`."""
    base = ["--port", "0", *(args or [])]
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    procs = [ReplicaProcess(base, env, ready_timeout,
                            None if log_dir is None else os.path.join(log_dir, f"replica-{i}.log")) for i in range(n)]
    try:
        return [p.wait_ready() for p in procs]
    except BaseException:
        for p in procs:
            p.stop()
        raise


def restart_on_port(replica: ReplicaProcess, env: dict | None = None, timeout: float = 120.0) -> ReplicaProcess:
    """A fresh replica with the same arguments on the same port (a restart after a crash)."""
    port = replica.port
    args = [a for a in replica.args]
    i = args.index("--port")
    args[i + 1] = str(port)
    deadline = time.monotonic() + timeout
    while True:  # the old socket may linger for a moment
        fresh = ReplicaProcess(args, env, timeout, replica.log_path)
        try:
            return fresh.wait_ready()
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
