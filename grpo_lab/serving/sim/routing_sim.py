"""Replay a GRPO trace through a routing policy against simulated replicas, and score it.

A discrete-event simulation of the async trainer's rollout loop: up to `max_in_flight` rollouts outstanding, the
policy version (the adapter name seeding the hash chain) bumped every `completions_per_sync` finished rollouts.
Each simulated replica has an LRU prefix cache of `cache_blocks` KV blocks, cached when a request is scheduled (as in
vLLM v1); with `cache_holds_running` it is vLLM's paged pool, shared with running requests (a request waits until its
blocks fit). Service time is prefill of the uncached tokens plus decode, slower as a batch grows, so an unbalanced
router pays in latency. `replay` drives any policy of `routing.registry.POLICIES` through the router's own calls and
times every decision (the router's added latency).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal

from grpo_lab.lab.settings import Range, check_fields, setting

from ..routing.policy import AFFINITY, SPILLED, UNMATCHED, Decision, RoutingConfig
from ..routing.registry import DEFAULT_POLICY, make_policy
from .trace import TraceGroup


@dataclass
class SimConfig:
    """Simulated replicas and rollout loop. `arrivals`: "group" (a prompt's G rollouts together, once all fit) or
    "rollout" (one per free slot, TRL 1.16's worker). `versioning`: "rollout" (each rollout names the version current
    when it starts, TRL's: a group can straddle a bump) or "group" (all G name the first one's, grpo_lab's loop).
    `batch_slowdown`: decode time grows by this factor per request in the batch (memory-bound decode)."""

    num_replicas: int = 2
    max_in_flight: int = 128
    completions_per_sync: int = 128
    adapter_prefix: str = "trl-policy"
    cache_blocks: int = setting(200_000, check=Range(0))
    cache_holds_running: bool = False
    prefill_s_per_token: float = 5e-5
    decode_s_per_token: float = 0.01
    batch_slowdown: float = 0.004
    arrivals: Literal["group", "rollout"] = "group"
    versioning: Literal["group", "rollout"] = "rollout"

    def __post_init__(self):
        check_fields(self)


@dataclass
class _Request:
    hashes: list
    prompt_tokens: int
    completion_tokens: int
    decision: Decision
    private_blocks: int = 0
    cached_tokens: int = 0


class _SimReplica:
    """One replica's KV cache (LRU of prompt blocks, with pins while running) and its queue."""

    def __init__(self, capacity: int, holds_running: bool):
        self.capacity, self.holds_running = capacity, holds_running
        self.cache: OrderedDict[int, int] = OrderedDict()  # block -> running requests using it (0: evictable)
        self.private = 0  # blocks running requests hold outside the prefix cache (their completions)
        self.running = 0
        self.pinned = 0  # cached blocks some running request uses (cannot be evicted)
        self.queue: deque = deque()
        self.evictions = 0
        self.waits = 0  # requests that had to queue for KV space

    def fits(self, request: _Request) -> bool:
        if not self.holds_running or self.running == 0:
            return True  # vLLM runs a lone request even when it needs more than the pool (it preempts later)
        new = sum(1 for h in request.hashes if h not in self.cache)
        return self.pinned + self.private + new + request.private_blocks <= self.capacity

    def start(self, request: _Request) -> int:
        """Schedule `request`: cached prefix blocks found (a prefix), the rest cached; returns the hit count."""
        cache = self.cache
        hit = next((i for i, h in enumerate(request.hashes) if h not in cache), len(request.hashes))
        for h in request.hashes:
            cache[h] = cache.get(h, 0)
            cache.move_to_end(h)
        if self.holds_running:
            for h in request.hashes:
                if cache[h] == 0:
                    self.pinned += 1
                cache[h] += 1
            self.private += request.private_blocks
        self.running += 1
        self._evict()
        return hit

    def finish(self, request: _Request) -> None:
        self.running -= 1
        if self.holds_running:
            for h in request.hashes:
                pins = self.cache.get(h)
                if pins:
                    self.cache[h] = pins - 1
                    if pins == 1:
                        self.pinned -= 1
            self.private -= request.private_blocks
            self._evict()

    def _evict(self) -> None:
        """Drop least recently used blocks no running request uses until the cache fits its room."""
        room = self.capacity - (self.private if self.holds_running else 0)
        cache = self.cache
        while len(cache) > room:
            victim = next((h for h, pins in cache.items() if pins == 0), None)
            if victim is None:
                return  # everything left is in use: vLLM would preempt; the replay lets it run
            del cache[victim]
            self.evictions += 1


@dataclass
class ReplayResult:
    policy: str
    requests: int = 0
    kinds: dict = field(default_factory=lambda: {AFFINITY: 0, SPILLED: 0, UNMATCHED: 0})
    prompt_tokens: int = 0
    cacheable_tokens: int = 0  # tokens in full blocks (what any prefix cache could ever serve)
    cached_tokens: int = 0  # served from a replica's prefix cache
    per_replica: list = field(default_factory=list)
    decision_s: list = field(default_factory=list, repr=False)  # route + claim (+ hashing unless memoised)
    finish_s: float = 0.0  # total time releasing claims
    makespan_s: float = 0.0
    max_in_flight_seen: int = 0
    first_of_kind: int = 0  # requests whose (adapter, prompt) nobody asked for before: unmatched under any router
    evictions: int = 0  # prefix blocks evicted from replicas' caches
    kv_waits: int = 0  # requests that queued for KV space

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


def replay(trace: list[TraceGroup], sim: SimConfig | None = None, policy: str = DEFAULT_POLICY,
           routing: RoutingConfig | None = None, memo_hashes: bool = False) -> ReplayResult:
    """Replay `trace` with the routing policy registered as `policy`; `memo_hashes` hashes each (prompt, version) once
    (faster, but leaves hashing out of `decision_s`)."""
    sim = sim or SimConfig()
    routing = routing or RoutingConfig()
    router = make_policy(policy, sim.num_replicas, routing)
    bs = routing.block_size
    replicas = [_SimReplica(sim.cache_blocks, sim.cache_holds_running) for _ in range(sim.num_replicas)]
    result = ReplayResult(policy, per_replica=[0] * sim.num_replicas)
    candidates = list(range(sim.num_replicas))
    events: list = []  # (finish time, order, replica, request)
    order = itertools.count()
    now, finished, in_flight = 0.0, 0, 0
    # TRL's worker walks the groups rollout by rollout and starts one whenever a slot is free.
    stream = [(group, completion) for group in trace for completion in group.completion_tokens]
    next_request = 0
    seen: set = set()
    memo: dict = {}
    group_size = len(trace[0].completion_tokens) if trace else 1
    name = ""

    def begin(r: int, request: _Request) -> None:
        replica = replicas[r]
        hit = replica.start(request)
        request.cached_tokens = hit * bs
        result.cached_tokens += request.cached_tokens
        service = (request.prompt_tokens - request.cached_tokens) * sim.prefill_s_per_token + \
            request.completion_tokens * sim.decode_s_per_token * (1 + sim.batch_slowdown * replica.running)
        heapq.heappush(events, (now + service, next(order), r, request))

    while next_request < len(stream) or events:
        while next_request < len(stream) and in_flight < sim.max_in_flight:
            group, completion = stream[next_request]
            starts_group = next_request % group_size == 0
            if sim.arrivals == "group" and starts_group and in_flight + group_size > sim.max_in_flight:
                break  # wait until the whole group fits
            next_request += 1
            if starts_group or (sim.arrivals == "rollout" and sim.versioning == "rollout"):
                name = f"{sim.adapter_prefix}-v{finished // sim.completions_per_sync}"
            key = (name, group.prompt_index)
            if key not in seen:
                seen.add(key)
                result.first_of_kind += 1
            t0 = time.perf_counter()
            if not memo_hashes:
                hashes = router.hashes_for(group.prompt_ids, name)
            elif (hashes := memo.get(key)) is None:
                hashes = memo[key] = router.hashes_for(group.prompt_ids, name)
            decision = router.route(hashes, candidates)
            r = decision.replica
            result.kinds[decision.kind] = result.kinds.get(decision.kind, 0) + 1
            result.decision_s.append(time.perf_counter() - t0)
            tail = len(group.prompt_ids) - len(hashes) * bs
            request = _Request(hashes, len(group.prompt_ids), completion, decision,
                               private_blocks=math.ceil((tail + completion) / bs))
            result.requests += 1
            result.per_replica[r] += 1
            result.prompt_tokens += len(group.prompt_ids)
            result.cacheable_tokens += len(hashes) * bs
            in_flight += 1
            result.max_in_flight_seen = max(result.max_in_flight_seen, in_flight)
            replica = replicas[r]
            if not replica.queue and replica.fits(request):
                begin(r, request)
            else:
                replica.queue.append(request)
                replica.waits += 1
        if not events:
            break
        now, _, r, request = heapq.heappop(events)
        replica = replicas[r]
        replica.finish(request)
        in_flight -= 1
        finished += 1
        t0 = time.perf_counter()
        router.finish(request.decision, ok=True)
        result.finish_s += time.perf_counter() - t0
        while replica.queue and replica.fits(replica.queue[0]):
            begin(r, replica.queue.popleft())
    result.makespan_s = now
    result.evictions = sum(r.evictions for r in replicas)
    result.kv_waits = sum(r.waits for r in replicas)
    return result
