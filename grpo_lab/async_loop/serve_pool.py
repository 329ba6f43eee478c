"""`grpo-lab serve-pool`: one replica pool and a tenancy router, started once, that several training runs share.

From a terminal or in Python (`SharedPool`), as docs/shared_pool.md shows ("Start a pool, join it"). The
replicas get `--max-loras` = `adapter_slots` (the slots shared out: each run takes `max_staleness + 3`), the
router `RouterConfig.tenancy` (`serving.tenancy.runs`): runs register with the admin key, which this command
generates into a file only its owner can read and never prints; each run then gets a token of its own.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..lab.lifecycle import StartStop
from ..lab.settings import check_as
from ..serving.clusters.launcher import Cluster, ClusterSpec
from ..serving.tenancy.runs import TenancyConfig
from .loop_settings import PoolSettings
from .settings_parser import SettingsParser

PROG = "grpo-lab serve-pool"
POOL_FILE = "pool.json"  # in the state folder: the URL, the admin key's file and the pid, for scripts


# PoolConfig's fields that are `grpo-lab serve-pool` settings too, by their `PoolSettings` name.
SETTINGS_NAMES = {**{name: name for name in ("replicas", "replica_kind", "model", "adapter_slots", "max_lora_rank",
                                             "max_model_len", "replica_threads", "host", "state_dir",
                                             "admin_key_file", "max_in_flight_per_replica")},
                  "lease_s": "run_lease", "allow_base_model": "base_model"}


@dataclass
class PoolConfig:
    """A shared pool: replicas plus a router with tenancy. The fields in `SETTINGS_NAMES` are `grpo-lab serve-pool`
    settings, with `PoolSettings`' defaults, rules and help (`lease_s` is `run_lease`, `allow_base_model`
    `base_model`); `port` 0 is a free one. The others: `ready_timeout_s` (how long the replicas may take to listen)
    and `router` (extra `RouterConfig` fields)."""

    replicas: int = PoolSettings.replicas
    replica_kind: str = PoolSettings.replica_kind
    model: str | None = PoolSettings.model
    adapter_slots: int = PoolSettings.adapter_slots
    max_lora_rank: int = PoolSettings.max_lora_rank
    max_model_len: int = PoolSettings.max_model_len
    replica_threads: int = PoolSettings.replica_threads
    host: str = PoolSettings.host
    port: int = 0  # in Python a free one; the command's fixed default is PoolSettings.port
    state_dir: str = PoolSettings.state_dir
    admin_key_file: str | None = PoolSettings.admin_key_file
    lease_s: float = PoolSettings.run_lease
    max_in_flight_per_replica: int | None = PoolSettings.max_in_flight_per_replica
    allow_base_model: bool = PoolSettings.base_model
    ready_timeout_s: float = 300.0
    router: dict = field(default_factory=dict)

    def __post_init__(self):
        """The fields' rules are `PoolSettings`' (checked there, named here)."""
        check_as(PoolSettings, self, SETTINGS_NAMES)
        if self.max_in_flight_per_replica is None:
            self.max_in_flight_per_replica = 4 if self.replica_kind == "cpu" else 64

    @classmethod
    def from_settings(cls, settings: PoolSettings) -> "PoolConfig":
        """The pool the command's settings describe."""
        return cls(port=settings.port, **{name: getattr(settings, setting) for name, setting in SETTINGS_NAMES.items()})


def write_admin_key(path: str | os.PathLike) -> Path:
    """A fresh admin key in `path`, readable by its owner only; the key itself is never returned or printed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("grpo-pool-" + secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    return path


class SharedPool(StartStop):
    """Replicas + a tenancy router (a child process this one restarts if it dies): `start()` (or `with`), `url`,
    `admin_key_file`, `runs()`, `stop()`."""

    def __init__(self, config: PoolConfig | None = None):
        self.config = config or PoolConfig()
        self.state_dir = Path(self.config.state_dir)
        self.admin_key_file = str(self.config.admin_key_file or self.state_dir / "admin.key")
        self.cluster: Cluster | None = None

    @property
    def handle(self):
        """The router's `SupervisedRouter` (register_run, remove_run, runs, ...)."""
        return self.cluster.router

    @property
    def url(self) -> str:
        return self.handle.url

    def start(self) -> "SharedPool":
        c = self.config
        model = c.model
        if model is None:
            from ..tasks.embedded_model import embedded_model_dir

            model = str(embedded_model_dir())
        write_admin_key(self.admin_key_file)
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        tenancy = TenancyConfig(lease_s=c.lease_s, max_in_flight_per_replica=c.max_in_flight_per_replica,
                                allow_base_model=c.allow_base_model)
        router = {"host": c.host, "port": c.port, "admin_api_key_file": self.admin_key_file,
                  "tenancy": tenancy, **c.router}
        spec = ClusterSpec(replicas=c.replicas, kind=c.replica_kind, model=model, adapter_slots=c.adapter_slots,
                           lora_rank=c.max_lora_rank, max_model_len=c.max_model_len,
                           replica_threads=c.replica_threads, router=router, log_dir=str(logs))
        # the router in a supervised child process, restarted on its port with the runs and live adapters it had
        self.cluster = Cluster(spec, router_dir=str(self.state_dir / "router")).start(timeout=c.ready_timeout_s)
        (self.state_dir / POOL_FILE).write_text(json.dumps(
            {"url": self.url, "admin_key_file": os.path.abspath(self.admin_key_file), "pid": os.getpid(),
             "replicas": c.replicas, "replica_kind": c.replica_kind, "adapter_slots": c.adapter_slots,
             "lease_s": c.lease_s, "max_in_flight_per_replica": c.max_in_flight_per_replica}, indent=1) + "\n")
        return self

    def runs(self) -> list[dict]:
        """The runs sharing the pool now (never their tokens)."""
        return self.handle.runs()

    def stop(self) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.stop()


def build_parser() -> SettingsParser:
    """The command line, generated from `PoolSettings` (each field one flag, its default and rule there)."""
    return SettingsParser(PoolSettings, PROG, description=(
        "Start replicas and a router that several `grpo-lab async-loop --router-url URL --run-name NAME` runs share: "
        "each run gets its own adapter namespace, token, share of adapter slots and weighted fair share of the "
        "replicas. Runs until Ctrl-C or SIGTERM."))


def main(argv=None) -> int:
    from .checks import UsageError, check_model, check_port, check_writable_folder, failed

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = build_parser().parse(argv)
        check_port("--port", a.port, a.host if a.host != "0.0.0.0" else "127.0.0.1")
        check_writable_folder("--state-dir", a.state_dir)
        if a.admin_key_file:
            check_writable_folder("--admin-key-file", os.path.dirname(os.path.abspath(a.admin_key_file)))
        if a.model is not None:
            check_model("--model", a.model)
        config = PoolConfig.from_settings(a)
    except SystemExit as stop:  # a refused flag (status 2, its one line printed) or --help (0)
        return int(stop.code or 0)
    except (UsageError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    pool = SharedPool(config)
    try:
        pool.start()
    except Exception as error:  # noqa: BLE001 - one line for the user
        return failed(PROG, error, os.path.join(a.state_dir, "logs"))
    key = os.path.abspath(pool.admin_key_file)
    print(f"shared pool ready: {pool.url} ({config.replicas} {config.replica_kind} replicas, {config.adapter_slots} "
          f"adapter slots each, run lease {config.lease_s:g}s)\n"
          f"admin key in {key} (mode 0600; runs register with it, it is never printed)\n"
          f"join it: grpo-lab async-loop --router-url {pool.url} --run-name NAME --pool-admin-key-file {key}",
          flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        pool.stop()
        print("shared pool stopped: replicas and router", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
