"""The routing-policy seam: what the router and the replay simulator ask of a policy, and what policies share
(docs/serving.md, "Adding a routing policy").

Both drive the same policy objects through the same calls, so what the replay measures is what the router serves.
Replicas are numbers 0..n-1; a prompt arrives as its chained KV-block hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from grpo_lab.lab.settings import Range, check_fields, setting

from .prefix_hash import DEFAULT_BLOCK_SIZE, block_hashes

# Why a request went where it went. A policy without a prefix preference routes everything "unmatched".
AFFINITY, SPILLED, UNMATCHED = "affinity", "spilled", "unmatched"


@dataclass
class RoutingConfig:
    """Parameters every routing policy is built with (`spill_threshold` and `max_blocks` are the prefix rules').

    Args:
        block_size: tokens per KV block; the router replaces it with the replicas' `cache_config.block_size`.
        spill_threshold: K, how many requests in flight the affine replica may be ahead of the least loaded one
            before the request spills to the least loaded one.
        max_blocks: bound on the block records kept (LRU); about 145 bytes each (see `prefix_affinity`).
    """

    block_size: int = setting(DEFAULT_BLOCK_SIZE, check=Range(1))
    spill_threshold: int = setting(8, check=Range(0))
    max_blocks: int = setting(1_000_000, check=Range(1))

    def __post_init__(self):
        check_fields(self)


@dataclass
class Decision:
    """Where one request goes and why; hand it back to `finish` when the upstream has answered."""

    replica: int
    kind: str = UNMATCHED  # affinity | spilled | unmatched
    matched_blocks: int = 0  # prompt-specific blocks the chosen-by-affinity replica held (0 when unmatched)
    hashes: list[int] = field(repr=False, default_factory=list)
    done: bool = False


@runtime_checkable
class RoutingPolicy(Protocol):
    """What the router (`router.replica_pool`, `routing.forwarding`, `/metrics`, `/router/state`) and the simulator
    call. One event loop calls it; it need not be thread-safe. A factory `(num_replicas, RoutingConfig)` builds one."""

    config: RoutingConfig  # the pool sets `block_size` to the replicas' own
    in_flight: list[int]  # requests routed and not finished, per replica number (caps, hedge budget, gauges)
    counts: dict[str, int]  # decisions by kind (`/router/state`)

    @property
    def num_blocks(self) -> int:
        """Block records the policy holds (a gauge); 0 for one that keeps none."""

    def hashes_for(self, token_ids: Sequence[int], namespace: str) -> list[int]:
        """The prompt's chained KV-block hashes, seeded with the adapter name."""

    def route(self, hashes: list[int], candidates: Sequence[int]) -> Decision:
        """Pick one of `candidates` (in service and holding the model; never empty) and count it in flight."""

    def finish(self, decision: Decision, ok: bool) -> None:
        """The request of `decision` ended (`ok`: answered 200). Called at least once per decision; idempotent."""

    def ensure_replicas(self, n: int) -> None:
        """Make room for replica numbers 0..n-1 (a replica joined); what is known about the others is kept."""

    def forget_replica(self, r: int) -> None:
        """Replica `r` restarted or left (its number may be reused): drop what the policy believes it caches."""


class BasePolicy:
    """The bookkeeping of a `RoutingPolicy`; subclasses implement `choose` (and `claim` / `release` if they keep
    state per request). Not thread-safe: call it from one event loop."""

    def __init__(self, num_replicas: int, config: RoutingConfig | None = None):
        if num_replicas < 1:
            raise ValueError("need at least one replica")
        self.config = config or RoutingConfig()
        self.num_replicas = num_replicas
        self.in_flight = [0] * num_replicas
        self.counts = {AFFINITY: 0, SPILLED: 0, UNMATCHED: 0}
        self._rr = 0

    # -- what a policy says ----------------------------------------------------------------------------------------
    def choose(self, hashes: list[int], candidates: Sequence[int]) -> Decision:
        """Where this request goes (one of `candidates`) and why."""
        raise NotImplementedError

    def claim(self, decision: Decision) -> None:
        """Record what routing `decision` means before it is answered (pending claims); nothing by default."""

    def release(self, decision: Decision, ok: bool) -> None:
        """Its request ended (`ok`: answered 200): undo `claim`, record what the answer proves; nothing by default."""

    def forget_replica(self, r: int) -> None:
        """Nothing is held per replica by default."""

    @property
    def num_blocks(self) -> int:
        return 0

    # -- the bookkeeping ----------------------------------------------------------------------------------------
    def least_loaded(self, candidates: Sequence[int]) -> int:
        """The candidate with the fewest requests in flight; ties taken in turn."""
        low = min(self.in_flight[r] for r in candidates)
        tied = [r for r in candidates if self.in_flight[r] == low]
        pick = tied[self._rr % len(tied)]
        self._rr += 1
        return pick

    def hashes_for(self, token_ids: Sequence[int], namespace: str) -> list[int]:
        return block_hashes(token_ids, namespace, self.config.block_size)

    def route(self, hashes: list[int], candidates: Sequence[int]) -> Decision:
        if not candidates:
            raise ValueError("no candidate replica")
        decision = self.choose(hashes, candidates)
        self.counts[decision.kind] = self.counts.get(decision.kind, 0) + 1
        self.in_flight[decision.replica] += 1
        self.claim(decision)
        return decision

    def finish(self, decision: Decision, ok: bool) -> None:
        if decision.done:
            return
        decision.done = True
        self.in_flight[decision.replica] -= 1
        self.release(decision, ok)

    def ensure_replicas(self, n: int) -> None:
        if n > self.num_replicas:
            self.in_flight.extend([0] * (n - self.num_replicas))
            self.num_replicas = n
