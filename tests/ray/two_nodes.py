"""A real two-node Ray cluster on this machine, for the Ray tier: a head node and a worker node with distinct
resources, started by the tests and stopped by PID.

`ray start` runs each node in the foreground (`--block`), in its own session, with a unique `--temp-dir` and a
unique marker in its environment (`GRPO_LAB_RAY_SESSION`), which every process of the node inherits (GCS, raylet,
agents, worker processes, and the replica servers the actors start). Stopping sends SIGTERM to the two `ray start`
processes only (each stops the processes it started); `session_processes()` then finds whatever still carries the
marker, so a leftover is seen and killed by PID, never by name: `ray stop` would stop every Ray on the machine.
Every port is picked free, so two sessions (or another user's Ray) do not collide.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

MARKER = "GRPO_LAB_RAY_SESSION"
HEAD_RESOURCES = {"trainer_node": 1}
WORKER_RESOURCES = {"replica_node": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ports() -> list[str]:
    """Every port a node opens, picked free (the defaults include fixed ones, e.g. the agent's 52365)."""
    return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]


def session_processes(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries `marker` (Ray renames its workers, so names cannot be trusted)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@dataclass
class TwoNodeCluster:
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    address: str = ""
    temp_dir: str = ""
    head: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    started_s: float = 0.0
    log_dir: str = ""

    def env(self) -> dict:
        env = {**os.environ, MARKER: self.marker, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        return env

    def _ray_start(self, args: list[str], name: str) -> subprocess.Popen:
        ray_cli = str(Path(sys.executable).with_name("ray"))
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        return subprocess.Popen([ray_cli, "start", "--block", "--disable-usage-stats", "--include-log-monitor=false",
                                 "--object-store-memory=100000000", f"--temp-dir={self.temp_dir}", *_ports(), *args],
                                env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout: float = 180.0) -> TwoNodeCluster:
        t0 = time.monotonic()
        self.temp_dir = tempfile.mkdtemp(prefix=f"ray-{self.marker[:8]}-")
        self.log_dir = tempfile.mkdtemp(prefix=f"ray-logs-{self.marker[:8]}-")
        port = free_port()
        self.head = self._ray_start(["--head", f"--port={port}", "--num-cpus=1", "--num-gpus=0",
                                     f"--resources={json.dumps(HEAD_RESOURCES)}", "--include-dashboard=false",
                                     *_client_server_port()], "head")
        host = None
        deadline = time.monotonic() + timeout
        while host is None:  # the GCS listens on the node's IP (Ray never uses loopback for a cluster)
            self._check_alive(deadline)
            for candidate in _local_addresses():
                with socket.socket() as s:
                    s.settimeout(0.2)
                    if s.connect_ex((candidate, port)) == 0:
                        host = candidate
                        break
            time.sleep(0.1)
        self.address = f"{host}:{port}"
        # one node at a time: on 2 busy cores, two nodes starting their agents together can pass Ray's fixed 30 s
        # wait for a raylet to register, and `ray start` then gives up
        self._wait_started("head", deadline)
        for attempt in range(2):
            self.worker = self._ray_start([f"--address={self.address}", "--num-cpus=2", "--num-gpus=0",
                                           f"--resources={json.dumps(WORKER_RESOURCES)}"], f"worker{attempt}")
            try:
                self._wait_started(f"worker{attempt}", deadline)
                break
            except RuntimeError:
                if attempt:
                    raise
        self.started_s = time.monotonic() - t0
        return self

    def _wait_started(self, name: str, deadline: float) -> None:
        while "Ray runtime started" not in self.log(name):
            proc = self.head if name == "head" else self.worker
            if proc.poll() is not None:
                raise RuntimeError(f"ray start ({name}) exited with {proc.returncode}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray start ({name}) did not finish:\n{self.log(name)}")
            time.sleep(0.2)

    def _check_alive(self, deadline: float) -> None:
        for name, proc in (("head", self.head), ("worker", self.worker)):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"ray start ({name}) exited with {proc.returncode}:\n{self.log(name)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray cluster did not come up:\n{self.log('head')}\n{self.log('worker')}")

    def wait_nodes(self, ray, timeout: float = 120.0) -> list[dict]:
        """After `ray.init(address)`: wait until both nodes are alive; returns them."""
        deadline = time.monotonic() + timeout
        while True:
            nodes = [n for n in ray.nodes() if n["Alive"]]
            if len(nodes) >= 2:
                return nodes
            self._check_alive(deadline)
            time.sleep(0.2)

    def log(self, name: str) -> str:
        try:
            return Path(self.log_dir, f"{name}.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> list[str]:
        """SIGTERM the two `ray start` processes (each stops its node), wait, then kill by PID whatever still
        carries the marker. Returns descriptions of those leftovers (empty when the stop was clean)."""
        for proc in (self.worker, self.head):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in (self.worker, self.head):
            if proc is not None:
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        left = wait_gone_marked(self.marker, 20.0)
        described = []
        for proc in left:
            try:
                described.append(f"{proc.pid} {proc.name()} {' '.join(proc.cmdline())[:120]}")
                proc.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if not described:  # the `ray start` logs are kept only when something went wrong
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return described


def wait_gone_marked(marker: str, timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in session_processes(marker) if _running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _client_server_port() -> list[str]:
    """A free port for Ray Client's server when `ray[client]` is installed (its default 10001 may be taken); minimal
    Ray refuses the flag, and starts no client server without it."""
    from ray._private.utils import get_ray_client_dependency_error

    return [] if get_ray_client_dependency_error() is not None else [f"--ray-client-server-port={free_port()}"]


def _local_addresses() -> list[str]:
    addresses = []
    for infos in psutil.net_if_addrs().values():
        for info in infos:
            if info.family == socket.AF_INET:
                addresses.append(info.address)
    return sorted(addresses, key=lambda a: a.startswith("127."))  # the node IP first
