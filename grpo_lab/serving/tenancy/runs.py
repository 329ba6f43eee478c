"""Runs as tenants of one router: several LoRA runs share one replica pool, each in a namespace of its own.

Every TRL run names its versions `trl-policy-vN` and pauses "the server" around each sync, so runs on one plain router
would load over and unload each other's adapters. This module is the router's record of who is who: a namespace per
run (its `trl-policy-v3` is `<run>--trl-policy-v3` upstream, `upstream_name`), a bearer token kept only as its SHA-256
digest, a share of every replica's `max_loras` (`adapters.slots.max_loras_for`: a load never needs another run's
slot) and a lease. What each buys and how a run uses them: docs/shared_pool.md.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import time
from dataclasses import dataclass, field

from grpo_lab.lab.settings import Range, check_fields, setting

from ..adapters.slots import max_loras_for

SEPARATOR = "--"  # between a run's name and its adapter's name upstream; run names never contain it
MAX_RUN_NAME = 48
_RUN_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.]|-(?!-))*")  # letters, digits, '_', '.', single '-'


class TenancyError(ValueError):
    """A registration the router refuses: `status` is the HTTP status it answers with, `kind` vLLM's error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class TenancyConfig:
    """How a router shares its replicas between runs (`RouterConfig.tenancy`; None: one client, no runs).

    Args:
        lease_s: a run that has sent no request for this long, and has none in flight or queued, is reclaimed: its
            adapters are unloaded and it is removed (its token stops working, its slots are free). A joined
            `grpo-lab async-loop` renews it every `lease_s / 4` even while its trainer only trains, so only a dead
            process lets it lapse.
        max_in_flight_per_replica: completions the router lets run on each in-service replica at once; beyond that
            they wait at the router, where `fair_queue` decides whose goes next, and go to a replica with room.
            Set it to what keeps a replica busy: vLLM batches (tens to hundreds), grpo_lab's CPU replica serves one
            at a time (`serve-pool` uses 4: one running, a few ready). Larger is faster, smaller is fairer.
        allow_base_model: whether runs may complete with the base model (and its aliases, e.g. `trl-policy-v0`,
            which TRL names before its first sync). False answers 403.
        max_runs: the most runs registered at once.
        adapter_slots: adapter slots per replica to share out; None (default) is the replicas' own `max_loras`.
        max_weight: the largest fair-share weight a run may ask for.
    """

    lease_s: float = setting(120.0, check=Range(0, open=True))
    max_in_flight_per_replica: int = setting(64, check=Range(1))
    allow_base_model: bool = True
    max_runs: int = setting(32, check=Range(1))
    adapter_slots: int | None = setting(None, check=Range(1))
    max_weight: float = setting(100.0, check=Range(1))

    def __post_init__(self):
        check_fields(self)


def check_run_name(name) -> str:
    """`name` if a run may be called that (ValueError otherwise): letters, digits, '_', '.', single '-', at most
    48 characters, starting with a letter or digit. No '--', so a run's prefix can never be another run's."""
    if not isinstance(name, str) or not name:
        raise ValueError("a run needs a name (letters, digits, '_', '.', '-')")
    if len(name) > MAX_RUN_NAME or not _RUN_NAME.fullmatch(name):
        raise ValueError(f"run name {name!r} must be at most {MAX_RUN_NAME} letters, digits, '_', '.' or single "
                         f"'-', starting with a letter or digit ('{SEPARATOR}' separates a run from its adapters)")
    return name


def upstream_name(run: str, adapter: str) -> str:
    """What the replicas call `adapter` of `run`."""
    return f"{run}{SEPARATOR}{adapter}"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass
class Run:
    """One registered run. Its token is not here: only its digest, which cannot be turned back into it."""

    name: str
    max_staleness: int
    weight: float
    slots: int
    digest: bytes = field(repr=False)
    registered_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    loading: set[str] = field(default_factory=set)  # upstream names whose load is under way
    paused: bool = False  # TRL paused "the server": this run's queued completions wait (`fair_queue`)

    @property
    def prefix(self) -> str:
        return self.name + SEPARATOR

    def owns(self, upstream: str) -> bool:
        return upstream.startswith(self.prefix)

    def upstream(self, adapter: str) -> str:
        return upstream_name(self.name, adapter)

    def client_name(self, upstream: str) -> str:
        """The name this run knows its adapter `upstream` by."""
        return upstream[len(self.prefix):] if self.owns(upstream) else upstream

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def idle_s(self) -> float:
        return time.monotonic() - self.last_seen

    def describe(self) -> dict:
        return {"name": self.name, "max_staleness": self.max_staleness, "weight": self.weight, "slots": self.slots,
                "namespace": self.prefix, "idle_s": round(self.idle_s(), 3), "paused": self.paused,
                "registered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.registered_at))}


class RunRegistry:
    """The runs of one router, found by name or by token. Not thread-safe: the router's event loop owns it."""

    def __init__(self, config: TenancyConfig):
        self.config = config
        self.runs: dict[str, Run] = {}
        self._by_digest: dict[bytes, Run] = {}

    def slots_taken(self, but: str | None = None) -> int:
        return sum(r.slots for r in self.runs.values() if r.name != but)

    def register(self, name, max_staleness, weight, capacity: int | None, replace: bool = False) -> tuple[Run, str]:
        """A new run (or, with `replace`, a new token for an existing one, which keeps its adapters: a resumed
        process). Returns the run and its token, which is not kept anywhere. TenancyError says why not."""
        try:
            name = check_run_name(name)
        except ValueError as error:
            raise TenancyError(str(error)) from None
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise TenancyError(f"'max_staleness' must be an integer >= 0, got {max_staleness!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 < weight <= self.config.max_weight:
            raise TenancyError(f"'weight' must be a number in (0, {self.config.max_weight:g}], got {weight!r}")
        old = self.runs.get(name)
        if old is not None and not replace:
            raise TenancyError(f"run '{name}' is already registered (another process uses that name?): pick another "
                               "name, or re-register it with replace=true to resume it", 409, "Conflict")
        if old is None and len(self.runs) >= self.config.max_runs:
            raise TenancyError(f"the router already has {len(self.runs)} runs (max_runs)", 409, "Conflict")
        slots = max_loras_for(max_staleness)
        if capacity is None:
            raise TenancyError("no replica in service yet: the pool's adapter slots are not known", 503,
                               "ServiceUnavailable")
        free = capacity - self.slots_taken(but=name)
        if slots > free:
            others = ", ".join(f"{r.name} {r.slots}" for r in self.runs.values() if r.name != name) or "none"
            raise TenancyError(
                f"run '{name}' needs {slots} adapter slots per replica (max_staleness {max_staleness} + 3) but only "
                f"{max(free, 0)} of the pool's {capacity} are free (taken: {others}): lower max_staleness, or start "
                f"the pool with more --max-loras", 409, "Conflict")
        token = "grpo-run-" + secrets.token_urlsafe(32)
        run = self.runs.setdefault(name, Run(name, max_staleness, float(weight), slots, _digest(token)))
        self._by_digest.pop(run.digest, None)  # a replaced run keeps its record (and adapters), not its old token
        run.digest, run.max_staleness, run.weight, run.slots = _digest(token), max_staleness, float(weight), slots
        run.touch()
        self._by_digest[run.digest] = run
        return run, token

    def snapshot(self) -> list[dict]:
        """The runs as a restarted router needs them (`router.state_file`): never a token, only its digest."""
        return [{"name": r.name, "max_staleness": r.max_staleness, "weight": r.weight, "slots": r.slots,
                 "digest": r.digest.hex(), "registered_at": r.registered_at, "paused": r.paused}
                for r in self.runs.values()]

    def restore(self, saved: list[dict]) -> list[Run]:
        """Take back the runs a crashed router had (`snapshot`): their tokens keep working, their leases start anew.
        Returns the runs taken back."""
        restored = [Run(e["name"], int(e["max_staleness"]), float(e["weight"]), int(e["slots"]),
                        bytes.fromhex(e["digest"]), registered_at=float(e["registered_at"]),
                        paused=bool(e.get("paused", False))) for e in saved]
        for run in restored:
            self.runs[run.name] = run
            self._by_digest[run.digest] = run
        return restored

    def unregister(self, name: str) -> Run | None:
        run = self.runs.pop(name, None)
        if run is not None:
            self._by_digest.pop(run.digest, None)
        return run

    def authenticate(self, token: str) -> Run | None:
        """The run whose token this is, or None (the digest is looked up, then compared in constant time)."""
        if not token:
            return None
        digest = _digest(token)
        run = self._by_digest.get(digest)
        return run if run is not None and hmac.compare_digest(run.digest, digest) else None

    def lapsed(self, busy) -> list[Run]:
        """Runs silent for longer than the lease, with nothing in flight or queued (`busy(name)` says)."""
        return [r for r in self.runs.values() if r.idle_s() > self.config.lease_s and not busy(r.name)]
