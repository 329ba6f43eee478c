"""Replay a GRPO trace through the routing policy against simulated replicas, and score it.

The replay is a discrete-event simulation of the async trainer's rollout loop: up to `max_in_flight` rollouts are
outstanding, and the policy version (hence the adapter name that seeds the hash chain) bumps every
`completions_per_sync` finished rollouts. Arrivals are either `"group"` (a prompt's G rollouts arrive together, once
there is room for all of them: the issue's trace shape) or `"rollout"` (one at a time whenever a slot frees, each
naming the version current at that moment, as TRL 1.16's worker does; a group can then straddle a version bump, and
its rollouts after the bump match nothing anywhere, which raises the unmatched floor by about one rollout per sync).
Each simulated replica keeps an LRU prefix cache of blocks; as in vLLM v1, a request's blocks are cached when it is
scheduled, so rollouts of one group that reach the same replica share its prefill. Service time is prefill plus
decode, with decode slowing as a replica's batch grows, so an unbalanced router pays in latency.

`replay` runs the real `PrefixAffinityPolicy` (the one the HTTP router uses) or a round-robin baseline, and times
every routing decision, which is the router's own added latency.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .prefix_hash import block_hashes
from .routing_policy import AFFINITY, SPILLED, UNMATCHED, PrefixAffinityPolicy, RoutingConfig
from .trace import TraceGroup


@dataclass
class SimConfig:
    """Simulated replicas and rollout loop.

    Args:
        num_replicas: R independent replicas.
        max_in_flight: rollouts outstanding at once (the trainer's `max_inflight_tasks`).
        completions_per_sync: finished rollouts per policy version: completions per optimizer step (128 in seed 2)
            times TRL's `weight_sync_steps` (default 1).
        adapter_prefix: the adapter name is `{adapter_prefix}-v{version}`.
        cache_blocks: prefix-cache capacity of each replica, in blocks.
        prefill_s_per_token, decode_s_per_token: service-time model of one replica at batch size 1.
        batch_slowdown: decode time grows by this factor per request in the batch (memory-bound decode).
        arrivals: "group" (G rollouts together) or "rollout" (one per free slot, TRL's worker).
    """

    num_replicas: int = 2
    max_in_flight: int = 128
    completions_per_sync: int = 128
    adapter_prefix: str = "trl-policy"
    cache_blocks: int = 200_000
    prefill_s_per_token: float = 5e-5
    decode_s_per_token: float = 0.01
    batch_slowdown: float = 0.004
    arrivals: str = "group"

    def __post_init__(self):
        if self.arrivals not in ("group", "rollout"):
            raise ValueError(f"arrivals must be 'group' or 'rollout', got {self.arrivals!r}")


class _SimReplica:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.in_flight = 0

    def admit(self, hashes: list[int]) -> int:
        """Blocks of `hashes` found in cache (a prefix); caches the rest."""
        hit = 0
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
                hit += 1
            else:
                break
        for h in hashes[hit:]:
            self.cache[h] = None
            if len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        return hit


@dataclass
class ReplayResult:
    policy: str
    requests: int = 0
    kinds: dict = field(default_factory=lambda: {AFFINITY: 0, SPILLED: 0, UNMATCHED: 0})
    prompt_tokens: int = 0
    cacheable_tokens: int = 0  # tokens in full blocks (what any prefix cache could ever serve)
    cached_tokens: int = 0  # served from a replica's prefix cache
    per_replica: list = field(default_factory=list)
    decision_s: list = field(default_factory=list, repr=False)  # hash + route + claim, per request
    finish_s: float = 0.0  # total time releasing claims
    makespan_s: float = 0.0
    max_in_flight_seen: int = 0
    first_of_kind: int = 0  # requests whose (adapter, prompt) nobody asked for before: unmatched under any router

    @property
    def unmatched_floor(self) -> float:
        return self.first_of_kind / max(self.requests, 1)

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def cacheable_prefill_tokens(self) -> int:
        """Full-block tokens recomputed although a prefix cache could have served them."""
        return self.cacheable_tokens - self.cached_tokens

    def share(self, kind: str) -> float:
        return self.kinds[kind] / max(self.requests, 1)

    @property
    def decisions_per_s(self) -> float:
        """Requests routed per second of router CPU time (hashing, routing and release included)."""
        return self.requests / max(sum(self.decision_s) + self.finish_s, 1e-12)

    def latency_percentile(self, q: float) -> float:
        xs = sorted(self.decision_s)
        return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else 0.0


def replay(trace: list[TraceGroup], sim: SimConfig | None = None, policy: str = "prefix",
           routing: RoutingConfig | None = None) -> ReplayResult:
    """Replay `trace`; `policy` is "prefix" (the router's policy) or "round_robin"."""
    sim = sim or SimConfig()
    routing = routing or RoutingConfig()
    if policy not in ("prefix", "round_robin"):
        raise ValueError(f"unknown policy {policy!r}")
    router = PrefixAffinityPolicy(sim.num_replicas, routing)
    replicas = [_SimReplica(sim.cache_blocks) for _ in range(sim.num_replicas)]
    result = ReplayResult(policy, per_replica=[0] * sim.num_replicas)
    candidates = list(range(sim.num_replicas))
    events: list = []  # (finish time, seq, replica, decision)
    now, seq, finished, rr, in_flight = 0.0, 0, 0, 0, 0
    # TRL's worker walks the groups rollout by rollout and starts one whenever a slot is free, naming the policy
    # version current at that moment, so a group can straddle a full pipeline or a version bump.
    stream = [(group, completion) for group in trace for completion in group.completion_tokens]
    next_request = 0
    seen: set = set()
    group_size = len(trace[0].completion_tokens) if trace else 1
    name = ""
    while next_request < len(stream) or events:
        while next_request < len(stream) and in_flight < sim.max_in_flight:
            group, completion = stream[next_request]
            starts_group = next_request % group_size == 0
            if sim.arrivals == "group" and starts_group and in_flight + group_size > sim.max_in_flight:
                break  # wait until the whole group fits
            next_request += 1
            if sim.arrivals == "rollout" or starts_group:
                name = f"{sim.adapter_prefix}-v{finished // sim.completions_per_sync}"
            if (name, group.prompt_index) not in seen:
                seen.add((name, group.prompt_index))
                result.first_of_kind += 1
            t0 = time.perf_counter()
            hashes = block_hashes(group.prompt_ids, name, routing.block_size)
            if policy == "prefix":
                decision = router.route(hashes, candidates)
                r = decision.replica
                result.kinds[decision.kind] += 1
            else:
                decision, r = None, rr % sim.num_replicas
                rr += 1
            result.decision_s.append(time.perf_counter() - t0)
            replica = replicas[r]
            hit = replica.admit(hashes)
            cached = hit * routing.block_size
            result.requests += 1
            result.per_replica[r] += 1
            result.prompt_tokens += len(group.prompt_ids)
            result.cacheable_tokens += len(hashes) * routing.block_size
            result.cached_tokens += cached
            replica.in_flight += 1
            in_flight += 1
            result.max_in_flight_seen = max(result.max_in_flight_seen, in_flight)
            service = (len(group.prompt_ids) - cached) * sim.prefill_s_per_token + completion * (
                sim.decode_s_per_token * (1 + sim.batch_slowdown * replica.in_flight))
            heapq.heappush(events, (now + service, seq, r, decision))
            seq += 1
        if not events:
            break
        now, _, r, decision = heapq.heappop(events)
        replicas[r].in_flight -= 1
        in_flight -= 1
        finished += 1
        if decision is not None:
            t0 = time.perf_counter()
            router.finish(decision, ok=True)
            result.finish_s += time.perf_counter() - t0
    result.makespan_s = now
    return result
