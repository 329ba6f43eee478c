"""What the Ray tests check: a router's or replica's metrics and adapters, and after a teardown no actor of ours
alive, no server process left, no placement group."""

from __future__ import annotations

import os
import time

import psutil
import requests

from grpo_lab.serving.wire.metrics import parse_text


def metric(url: str, name: str, **labels) -> float:
    """The sum of Prometheus samples `name` with `labels` that `url/metrics` shows."""
    values = parse_text(requests.get(url + "/metrics", timeout=10).text)
    return sum(v for k, v in values.items()
               if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()))


def adapters_on(url: str) -> set[str]:
    """The LoRA adapters `url` serves (`/v1/models` entries with a parent)."""
    return {m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"] if m.get("parent")}


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a replica's watchdog leads its server's group)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def leftovers(infos: list[dict]) -> list[str]:
    """Actor processes and server process groups of `infos` (`ReplicaServer.info()`) still alive."""
    left = []
    for info in infos:
        if psutil.pid_exists(info["actor_pid"]):
            try:
                if psutil.Process(info["actor_pid"]).status() != psutil.STATUS_ZOMBIE:
                    left.append(f"actor {info['actor_pid']}")
            except psutil.Error:
                pass
        left += [f"server {pid}" for pid in group_members(info["server_pid"])]
    return left


def wait_torn_down(infos: list[dict], timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := leftovers(infos)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def live_actors(ray, class_name: str = "ReplicaServer") -> list[str]:
    """Actors of `class_name` the cluster does not count as dead (GCS's actor table; no dashboard needed)."""
    table = ray._private.state.state.actor_table(None)
    return [actor_id for actor_id, a in table.items() if a["ActorClassName"] == class_name and a["State"] != "DEAD"]


def wait_no_live_actors(ray, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (alive := live_actors(ray)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def live_placement_groups(ray) -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]
