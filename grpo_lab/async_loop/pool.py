"""A training run joining a shared replica pool (`grpo-lab serve-pool`) as one of its tenants.

Joining is three things: **register** with the pool's admin key (`--pool-admin-key-file`, else
`$GRPO_LAB_POOL_ADMIN_KEY_FILE`, else `$GRPO_LAB_POOL_ADMIN_KEY`), which answers the run's token once; **carry the
token** in this process's environment (`$GRPO_LAB_RUN_TOKEN`, inherited by the spawned rollout worker), never in a
config, command line, checkpoint or log; **keep the lease**, renewed every `lease_s / 4`, so a killed process's
adapters are reclaimed after `lease_s`. A run that ends normally leaves, freeing its slots.
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.parse

from ..lab import environment

log = logging.getLogger(__name__)

RUN_TOKEN_ENV = environment.RUN_TOKEN
ADMIN_KEY_ENV = environment.POOL_ADMIN_KEY
ADMIN_KEY_FILE_ENV = environment.POOL_ADMIN_KEY_FILE
DEFAULT_RUN_NAME = "loop"  # `--run-name` when none is given: the run's results, trackers and pool name


def pool_name(run_name: str | None, pool_run: str | None) -> tuple[str, str]:
    """The run's name on a shared pool and the flag it came from: `--pool-run`, else `--run-name` (the one rule,
    read by `LoopSettings.pool_name` and by the command's early pool check before the settings are parsed)."""
    if pool_run is not None:
        return pool_run, "--pool-run"
    return run_name or DEFAULT_RUN_NAME, "--run-name"


def admin_key_file(flag_value: str | None = None) -> str | None:
    """The file the pool's admin key is read from: the flag's, else `$GRPO_LAB_POOL_ADMIN_KEY_FILE`'s."""
    return flag_value or environment.pool_admin_key_file()


def has_admin_key(flag_value: str | None = None) -> bool:
    """Whether this process was given a pool's admin key (a file, or `$GRPO_LAB_POOL_ADMIN_KEY`)."""
    return bool(admin_key_file(flag_value) or environment.pool_admin_key())


def read_admin_key(flag_value: str | None = None) -> str:
    """The pool's admin key; ValueError saying where it was looked for when there is none (or the file is empty)."""
    from ..serving.router.config import read_secret

    key = read_secret(admin_key_file(flag_value), ADMIN_KEY_ENV, "the pool's admin key file")
    if not key:
        raise ValueError(f"no pool admin key: give --pool-admin-key-file, or set {ADMIN_KEY_FILE_ENV} (a file) or "
                         f"{ADMIN_KEY_ENV}")
    return key


def bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def run_headers() -> dict:
    """The headers a joined run's calls carry (its token), or {} when this process has not joined a pool."""
    return bearer(environment.run_token())


def run_get(url: str, path: str, timeout: float, **params) -> dict | None:
    """GET `path` of the router (or vLLM server) at `url` with the run's token: its JSON object, or None when it
    does not answer 200 with one."""
    import requests

    try:
        reply = requests.get(f"{url.rstrip('/')}{path}", params=params, timeout=timeout, headers=run_headers())
        body = reply.json() if reply.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None
    return body if isinstance(body, dict) else None


class PoolSeat:
    """This process's place in a shared pool at `url` as run `name`: `join()`, then `leave()` (or let the lease lapse
    if it dies). `rejoin` re-registers a run the pool still has (a resume: the old token stops working, its adapters
    stay for the resumed trainer to reconcile); without it such a name is refused."""

    def __init__(self, url: str, name: str, max_staleness: int, weight: float = 1.0,
                 admin_key_file: str | None = None, rejoin: bool = False):
        self.url, self.name, self.max_staleness, self.weight = url.rstrip("/"), name, max_staleness, weight
        self.admin_key_file, self.rejoin = admin_key_file, rejoin
        self.lease_s: float | None = None
        self.slots: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"PoolSeat({self.url!r}, {self.name!r})"

    @property
    def run_url(self) -> str:
        return f"{self.url}/router/runs/{urllib.parse.quote(self.name)}"

    def join(self) -> "PoolSeat":
        from ..serving.router.admin_client import RouterAdminClient

        key_file = admin_key_file(self.admin_key_file)
        client = RouterAdminClient(self.url, key_env=None if key_file else ADMIN_KEY_ENV, key_file=key_file)
        answer = client.register_run(self.name, self.max_staleness, self.weight, replace=self.rejoin)
        os.environ[RUN_TOKEN_ENV] = answer.pop("token")
        self.lease_s, self.slots = float(answer["lease_s"]), int(answer["slots"])
        self._stop.clear()
        self._thread = threading.Thread(target=self._keep_lease, name="grpo-lab-pool-lease", daemon=True)
        self._thread.start()
        log.info("joined the pool at %s as run %s (%d adapter slots per replica, lease %gs)", self.url, self.name,
                 self.slots, self.lease_s)
        return self

    def _keep_lease(self) -> None:
        import requests

        interval = max(self.lease_s / 4, 0.05)
        while not self._stop.wait(interval):
            try:
                answer = requests.get(self.run_url, headers=run_headers(), timeout=max(interval, 2.0))
            except requests.RequestException as error:
                log.warning("could not renew run %s's lease on %s: %s", self.name, self.url, type(error).__name__)
                continue
            if answer.status_code in (401, 404):
                log.error("the pool at %s no longer has run %s (its lease lapsed, or an admin removed it)",
                          self.url, self.name)
                return

    def leave(self) -> None:
        """Stop renewing the lease and remove the run from the pool (its adapters are unloaded there)."""
        import requests

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        headers = run_headers()
        if headers:
            try:
                requests.delete(self.run_url, headers=headers, timeout=30)
            except requests.RequestException as error:
                log.warning("could not leave the pool at %s (%s); the lease will reclaim run %s", self.url,
                            type(error).__name__, self.name)
        os.environ.pop(RUN_TOKEN_ENV, None)
