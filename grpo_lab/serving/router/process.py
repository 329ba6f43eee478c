"""The router as a supervised child process: restarted on the same port when it dies, rebuilt from the replicas and
its state file, while its clients retry (why, and what it costs: docs/serving.md, "When the router dies").

    router = SupervisedRouter(RouterConfig(replicas=urls, port=0), state_dir="runs/r1/logs",
                              members=lambda: placement.urls).start()
    router.wait_ready(); ... router.url ...; router.add_replica(url) ...; router.stop()

It has the calls a launcher makes on an in-process `RouterHandle`, over the router's admin endpoints
(`admin_client`). `python -m grpo_lab.serving.router.process CONFIG` is the child: it serves the pickled
`RouterConfig` in `CONFIG` (a file the supervisor writes, mode 0600) and prints `READY <port>` once it listens.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
from aiohttp import web

from ...lab.files import write_atomically
from ..replicas.processes import AnnouncingProcess, bind_listener, free_port
from .admin_client import RouterAdminClient
from .config import RouterConfig
from .membership import WaitsInService
from .server import Router

log = logging.getLogger(__name__)

STATE_FILE, CONFIG_FILE, LOG_FILE = "router-state.json", "router.config", "router.log"
BIND_RETRY_S = 10.0  # a router restarted on its port waits this long for the dead one's socket to go


class RouterChild(AnnouncingProcess):
    """`python -m grpo_lab.serving.router.process CONFIG` under the watchdog, ready when it prints `READY <port>`."""

    name = "router"

    def __init__(self, config_path: Path, log_path: Path, ready_timeout: float):
        self.config_path = config_path
        super().__init__(None, ready_timeout, log_path)

    def command(self) -> list[str]:
        return [sys.executable, "-u", "-m", "grpo_lab.serving.router.process", str(self.config_path)]

    @property
    def router_pid(self) -> int | None:
        """The router's own process (the watchdog's child), what a crash or `kill -9` would hit."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.Error:
            return None
        return children[0].pid if children else None


class SupervisedRouter(RouterAdminClient, WaitsInService):
    """A router child process, restarted on the same port whenever it dies (at most `max_restarts` times).

    Args:
        config: the router's settings; `port` 0 picks a free port once, kept across restarts.
        state_dir: where its state file, its pickled config and its log go.
        members: the replica URLs a restarted router starts with (default: `config.replicas`).
        ready_timeout_s: how long one start may take.
    """

    def __init__(self, config: RouterConfig, state_dir: str | os.PathLike,
                 members: Callable[[], list[str]] | None = None, ready_timeout_s: float = 60.0,
                 max_restarts: int = 20, poll_s: float = 0.1):
        self.state_dir = Path(state_dir)
        port = config.port or free_port(config.host)
        self.config = replace(config, port=port, state_file=config.state_file or str(self.state_dir / STATE_FILE))
        self.members = members or (lambda: list(config.replicas))
        self.ready_timeout_s, self.max_restarts, self.poll_s = ready_timeout_s, max_restarts, poll_s
        self.process: RouterChild | None = None
        self.events: list[tuple[float, str, str]] = []
        self.recoveries_s: list[float] = []
        super().__init__(f"http://{config.host}:{port}", config.admin_api_key_env, config.admin_api_key_file)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- the child ------------------------------------------------------------------------------------------------
    def _spawn(self, replicas: list[str]) -> RouterChild:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / CONFIG_FILE
        write_atomically(path, pickle.dumps(replace(self.config, replicas=replicas)))  # mkstemp: mode 0600
        return RouterChild(path, self.state_dir / LOG_FILE, self.ready_timeout_s).wait_ready()

    def start(self) -> SupervisedRouter:
        Path(self.config.state_file).unlink(missing_ok=True)  # a new router: nothing of an earlier one's state
        self.process = self._spawn(list(self.config.replicas))
        self._watcher = threading.Thread(target=self._supervise, name="router-supervisor", daemon=True)
        self._watcher.start()
        return self

    def _supervise(self) -> None:
        restarts = 0
        while not self._stop.wait(self.poll_s):
            if self.process.alive():
                continue
            seen = time.monotonic()
            self.events.append((time.time(), "died", self.url))
            if restarts >= self.max_restarts:
                log.error("router at %s died again: not restarted (max_restarts=%d)", self.url, self.max_restarts)
                return
            restarts += 1
            log.warning("router at %s exited with %s: restarting it on the same port", self.url,
                        self.process.proc.returncode)
            try:
                fresh = self._spawn(self.members())
            except Exception as error:  # noqa: BLE001 - tried again at the next poll
                log.error("restarting the router failed: %s", str(error).splitlines()[0])
                continue
            if self._stop.is_set():
                fresh.stop()
                return
            self.process = fresh
            self.recoveries_s.append(time.monotonic() - seen)
            self.events.append((time.time(), "restarted", self.url))
            log.warning("router back at %s after %.1f s", self.url, self.recoveries_s[-1])

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.ready_timeout_s + 10)
        if self.process is not None:
            self.process.stop()

    # -- what a launcher calls --------------------------------------------------------------------------------
    def replica_died(self, url: str, why: str) -> bool:
        """Out of routing now, its completions re-sent; it rejoins (admitted once it serves with the live adapters)."""
        if self.remove_replica(url, 0.0) is None:
            return False
        self.add_replica(url)
        return True

    def runs(self) -> list[dict]:
        """The registered runs, as `RouterHandle.runs` lists them (the admin client's answer also has the slots)."""
        return super().runs()["runs"]


def main(argv=None) -> None:
    """The child: serve the pickled config, on its port even while a dead router's socket lingers."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], "rb") as f:
        config: RouterConfig = pickle.load(f)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(config)
    deadline = time.monotonic() + BIND_RETRY_S
    while (listener := bind_listener(config.host, config.port)) is None:
        if time.monotonic() > deadline:
            sys.exit(f"router: port {config.port} on {config.host} is still taken after {BIND_RETRY_S:.0f}s")
        time.sleep(0.1)
    print(f"READY {listener.getsockname()[1]}", flush=True)
    web.run_app(router.app(), sock=listener, access_log=None, print=None)


if __name__ == "__main__":
    main()
