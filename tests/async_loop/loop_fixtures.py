"""Real processes for the loop tests: CPU replicas serving the embedded model behind the router, on loopback."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import requests

from grpo_lab.tasks.embedded_model import embedded_model_dir
from grpo_lab.serving.clusters.local import LocalCluster
from grpo_lab.serving.wire.metrics import parse_text

MAX_STALENESS = 4


def start_cluster(replicas: int = 2) -> LocalCluster:
    return LocalCluster(replicas=replicas, model=str(embedded_model_dir()), max_staleness=MAX_STALENESS,
                        max_lora_rank=1, replica_args=["--max-model-len", "128", "--torch-threads", "1"]).start()


@pytest.fixture(scope="module")
def cluster():
    """Two CPU replicas and the router, shared by a module's tests (each trainer reconciles what it finds)."""
    c = start_cluster()
    yield c
    c.stop()
    assert not any(r.alive() for r in c.replicas)


def router_metric(url: str, name: str, **labels) -> float:
    values = parse_text(requests.get(url + "/metrics", timeout=10).text)
    total = 0.0
    for key, value in values.items():
        if key.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


def replica_adapters(url: str) -> dict[str, str]:
    """Adapters a replica holds now: name -> path."""
    data = requests.get(url + "/v1/models", timeout=10).json()["data"]
    return {e["id"]: e["root"] for e in data if e.get("parent")}


def wait_gone(pids, timeout: float = 20.0) -> list[int]:
    """Wait for processes to exit; returns the pids still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return alive


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: one per parent that used the spawn context, it exits with the parent."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def descendants(pid: int) -> list[int]:
    """Child processes of `pid` (recursively), multiprocessing's resource tracker aside."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True) if not _is_resource_tracker(c)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def no_leftover_children():
    """The test must leave no child process of this one behind (replicas, rollout workers)."""
    before = set(descendants(os.getpid()))
    yield
    leftover = wait_gone([p for p in descendants(os.getpid()) if p not in before], timeout=20)
    assert not leftover, f"processes left running: {leftover}"
