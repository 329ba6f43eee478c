"""One replica server inside a Ray actor: the actor starts the server as a child process, reports its URL, and lives
and dies with it.

Ray places and restarts *actors*, not arbitrary processes. The server starts through `replicas.processes` (watchdog,
readiness) under a second guard (`_GUARD`: Ray SIGKILLs the watchdog before it can act; docs/clusters.md), and the
actor exits when the server does, so `max_restarts` restarts the pair, on a new port with a new `incarnation`.
`__init__` returns once the server serves. Nothing here imports Ray at module level.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..replicas.processes import (CPUReplicaProcess, ReplicaProcess, VLLMReplicaProcess, free_port,
                                  vllm_cpu_python)
from ..replicas.vllm_spec import VLLMReplicaSpec

KINDS = ("cpu", "vllm", "fake")

# Runs the server as its child in the watchdog's process group. When the watchdog dies (SIGKILLed by Ray with the
# actor), the kernel sends this guard SIGUSR1 and it kills the whole group; SIGTERM (a graceful stop, sent to the
# group) is left to the server; the server's exit status is passed on.
_GUARD = r"""
import ctypes, os, signal, subprocess, sys
watchdog = os.getppid()
signal.signal(signal.SIGUSR1, lambda *_: os.killpg(0, signal.SIGKILL))
signal.signal(signal.SIGTERM, lambda *_: None)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGUSR1, 0, 0, 0)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass  # not Linux: the watchdog alone guards the server
if os.getppid() != watchdog:
    os.killpg(0, signal.SIGKILL)  # it died before the guard was set
sys.exit(subprocess.Popen(sys.argv[1:]).wait())  # a signal handled above does not break the wait (PEP 475)
"""


def guarded(command: list[str]) -> list[str]:
    """`command` under the guard above (the project's interpreter runs the guard; only the standard library)."""
    return [sys.executable, "-c", _GUARD, *command]


@dataclass
class ServerSpec:
    """What one actor serves: kind "cpu" (`cpu_args`), "vllm" (`vllm`: `VLLMReplicaSpec` fields; `device` picks the
    actor's GPU or the node's vllm-cpu venv) or "fake" (a model-free server, for launcher tests). The actor sets host,
    port, GPU and core. `env` travels through Ray's GCS: prefer a token the nodes already have. `host` None is the
    node's IP."""

    kind: str
    cpu_args: list[str] = field(default_factory=list)
    vllm: dict = field(default_factory=dict)
    device: str = "cuda"
    env: dict = field(default_factory=dict)
    host: str | None = None
    ready_timeout_s: float = 300.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


class GuardedCPUReplica(CPUReplicaProcess):
    def command(self) -> list[str]:
        return guarded(super().command())


class GuardedVLLMReplica(VLLMReplicaProcess):
    def command(self) -> list[str]:
        return guarded(super().command())


class GuardedFakeReplica(GuardedCPUReplica):
    """The model-free `fake_replica` in the CPU replica's place (it prints `READY <port>` too)."""

    name, module = "fake replica", "grpo_lab.serving.replicas.fake_replica"


def start_server(spec: ServerSpec, host: str, index: int) -> tuple[ReplicaProcess, str]:
    """Start the server `spec` describes on `host`; returns (process, url) once it serves."""
    if spec.kind != "vllm":  # the output also goes to a file on the node (vLLM's does already): `read_log`
        fd, log_path = tempfile.mkstemp(prefix=f"grpo-lab-replica-{index}-", suffix=".log")
        os.close(fd)
        kind, args = ((GuardedCPUReplica, ["--port", "0", *spec.cpu_args]) if spec.kind == "cpu"
                      else (GuardedFakeReplica, ["--ports", "0", "--delay-s", "0.05"]))
        process = kind(["--host", host, *args], spec.env, spec.ready_timeout_s, log_path)
        return process.wait_ready(), f"http://{host}:{process.port}"
    fields = dict(spec.vllm)
    if spec.device == "cpu":
        fields.setdefault("python", vllm_cpu_python())
        fields.setdefault("cpu_core", index % (os.cpu_count() or 1))
        fields.setdefault("max_model_len", None)
    else:  # the node's environment (this actor's interpreter) has vLLM; its console script may not be on PATH
        fields.setdefault("python", sys.executable)
    vllm = VLLMReplicaSpec(host=host, port=free_port(host), device=spec.device, **fields)
    return GuardedVLLMReplica(vllm, spec.env, spec.ready_timeout_s).wait_ready(), vllm.url


class ReplicaServer:
    """The actor class (wrapped with `ray.remote` by `ray_replicas`): one server per actor."""

    def __init__(self, spec: ServerSpec, index: int):
        import ray

        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.index = index
        began = time.monotonic()
        self.process, self.url = start_server(spec, spec.host or self.node_ip, index)
        self.ready_s = time.monotonic() - began
        self.incarnation = uuid.uuid4().hex
        self._stopping = False
        threading.Thread(target=self._die_with_server, name="die-with-server", daemon=True).start()

    def _die_with_server(self) -> None:
        self.process.proc.wait()
        if not self._stopping:  # the server exited on its own: end the actor so Ray restarts both
            print(f"replica server exited with {self.process.proc.returncode}; ending the actor", flush=True)
            os._exit(1)

    def info(self) -> dict:
        """Where the server is and which incarnation of the actor runs it."""
        return {"url": self.url, "index": self.index, "incarnation": self.incarnation, "node_id": self.node_id,
                "node_ip": self.node_ip, "actor_pid": os.getpid(), "server_pid": self.process.pid,
                "ready_s": round(self.ready_s, 2),
                "log": str(self.process.log_path)}

    def read_log(self, offset: int = 0, limit: int = 1 << 20) -> tuple[str, int, str]:
        """(incarnation, next offset, text): up to `limit` bytes of the server's log file on this node from
        `offset`, so a launcher can copy the log to the run's folder on another machine (`ray_logs`)."""
        with open(self.process.log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read(limit)
        return self.incarnation, offset + len(chunk), chunk.decode("utf-8", errors="replace")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); the actor is killed by its launcher afterwards."""
        self._stopping = True
        self.process.stop()
