"""A real two-node Ray cluster on this machine, for the Ray tier: a head node and a worker node with distinct
resources, each on a host of its own (a network namespace of `netns.Network`, with its own address), started by the
tests and stopped by PID.

`ray start` runs each node in the foreground (`--block`) inside its namespace (`ip netns exec`), in its own session,
with `--node-ip-address` set to the namespace's address (Ray's own guess needs a default route, which the hosts do
not have), a unique `--temp-dir` and a unique marker in its environment (`GRPO_LAB_RAY_SESSION`), which every process
of the node inherits (GCS, raylet, agents, worker processes, and the replica servers the actors start). Everything
between the nodes (raylet to GCS, object transfers, a router on the head calling replicas on the worker) crosses the
worker's veth, so `network.partition("worker")` cuts it. Each node has its namespace's ports to itself, so Ray's
default ports are used. Stopping sends SIGTERM to the two `ray start` processes only (each stops the processes it
started); `session_processes()` then finds whatever still carries the marker, so a leftover is seen and killed by
PID, never by name: `ray stop` would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from netns import Network

MARKER = "GRPO_LAB_RAY_SESSION"
HEAD, WORKER = "head", "worker"  # the hosts' roles on the network
HEAD_RESOURCES = {"trainer_node": 1}
WORKER_RESOURCES = {"replica_node": 4}
GCS_PORT = 6379  # Ray's default: the head's namespace has its ports to itself


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
    network: Network
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    address: str = ""
    temp_dir: str = ""
    head: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    started_s: float = 0.0
    log_dir: str = ""

    @property
    def head_ip(self) -> str:
        return self.network.address(HEAD)

    @property
    def worker_ip(self) -> str:
        return self.network.address(WORKER)

    def env(self) -> dict:
        env = {**os.environ, MARKER: self.marker, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        return env

    def _ray_start(self, role: str, args: list[str], name: str) -> subprocess.Popen:
        ray_cli = str(Path(sys.executable).with_name("ray"))
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        return self.network.popen(role, [
            ray_cli, "start", "--block", "--disable-usage-stats", "--include-log-monitor=false",
            "--object-store-memory=100000000", f"--temp-dir={self.temp_dir}",
            f"--node-ip-address={self.network.address(role)}", *args],
            env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout: float = 180.0) -> TwoNodeCluster:
        """Both hosts on the network, then the head, then the worker (their namespaces are removed by `stop`)."""
        t0 = time.monotonic()
        self.temp_dir = tempfile.mkdtemp(prefix=f"ray-{self.marker[:8]}-")
        self.log_dir = tempfile.mkdtemp(prefix=f"ray-logs-{self.marker[:8]}-")
        self.network.add_host(HEAD)
        self.network.add_host(WORKER)
        self.address = f"{self.head_ip}:{GCS_PORT}"
        deadline = time.monotonic() + timeout
        self.head = self._start_node(HEAD, ["--head", f"--port={GCS_PORT}", "--num-cpus=1", "--num-gpus=0",
                                            f"--resources={json.dumps(HEAD_RESOURCES)}", "--include-dashboard=false"],
                                     deadline)
        # one node at a time: on 2 busy cores, two nodes starting their agents together can pass Ray's fixed 30 s
        # wait for a raylet to register, and `ray start` then gives up
        self.worker = self._start_node(WORKER, [f"--address={self.address}", "--num-cpus=2", "--num-gpus=0",
                                                f"--resources={json.dumps(WORKER_RESOURCES)}"], deadline)
        self.started_s = time.monotonic() - t0
        return self

    def _start_node(self, role: str, args: list[str], deadline: float) -> subprocess.Popen:
        """`ray start` on `role`'s host, tried twice: on a loaded machine a node can miss Ray's fixed 30 s wait for
        its raylet to register; what the failed try left in the namespace is killed by PID before the second."""
        for attempt in range(2):
            proc = self._ray_start(role, args, f"{role}{attempt}")
            try:
                self._wait_started(proc, f"{role}{attempt}", deadline)
                return proc
            except RuntimeError:
                if attempt:
                    raise
                for pid in self.network.pids(role):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait(10)
        raise AssertionError("unreachable")

    def _wait_started(self, proc: subprocess.Popen, name: str, deadline: float) -> None:
        while "Ray runtime started" not in self.log(name):
            if proc.poll() is not None:
                raise RuntimeError(f"ray start ({name}) exited with {proc.returncode}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray start ({name}) did not finish:\n{self.log(name)}")
            time.sleep(0.2)

    def _check_alive(self, deadline: float) -> None:
        for role, proc in ((HEAD, self.head), (WORKER, self.worker)):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"ray start ({role}) exited with {proc.returncode}:\n{self.role_log(role)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray cluster did not come up:\n{self.role_log(HEAD)}\n{self.role_log(WORKER)}")

    def role_log(self, role: str) -> str:
        """The log of `role`'s last `ray start`."""
        return self.log(f"{role}1") or self.log(f"{role}0")

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
        for role in (WORKER, HEAD):
            self.network.remove_host(role)
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
