"""Prefix-affinity routing: send a rollout to the replica that already holds its prompt's KV blocks.

GRPO sends G rollouts of one prompt at once, so the win is keeping a group on one replica: its prompt is then
prefilled once instead of once per replica. The rule (seed 2's proxy, DESIGN.md §4) counts only *prompt-specific*
blocks: a block is *common* once every in-service replica has served it or once it has been followed by more than
one distinct block (a shared chat-template prefix; the request being routed counts as one), because such
blocks are cached everywhere anyway and would otherwise pull every request to whichever replica saw the template
first.

Two things differ from the published proxy:
- a request's blocks become *owned* by a replica only after that replica answered successfully; while it is in
  flight they are only a *pending claim*, enough to keep the rest of its group together, and dropped on failure;
- only replicas the caller marks eligible (in service and holding the adapter) are candidates, so a dead replica
  can never look least loaded, and `forget_replica` clears a replica's ownership when it is re-admitted.
Memory is bounded: block records live in an LRU of `max_blocks` entries, which drops a prompt's tail blocks
before its root.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefix_hash import DEFAULT_BLOCK_SIZE, block_hashes

AFFINITY, SPILLED, UNMATCHED = "affinity", "spilled", "unmatched"


@dataclass
class RoutingConfig:
    """Parameters of the prefix-affinity policy.

    Args:
        block_size: tokens per KV block; the router replaces it with the replicas' `cache_config.block_size`.
        spill_threshold: K, how many requests in flight the affine replica may be ahead of the least loaded one
            before the request spills to the least loaded one.
        max_blocks: bound on the block records kept (LRU); about 100 bytes each.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    spill_threshold: int = 8
    max_blocks: int = 1_000_000

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.spill_threshold < 0:
            raise ValueError(f"spill_threshold must be >= 0, got {self.spill_threshold}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")


class _Block:
    __slots__ = ("served", "pending", "successor", "branches")

    def __init__(self):
        self.served = 0  # bit r set: replica r answered a request containing this block
        self.pending: dict[int, int] | None = None  # replica -> requests in flight containing this block
        self.successor: int | None = None  # first block seen after this one
        self.branches = False  # a second, different successor was seen


@dataclass
class Decision:
    """Where one request goes and why; hand it back to `finish` when the upstream has answered."""

    replica: int
    kind: str  # affinity | spilled | unmatched
    matched_blocks: int  # prompt-specific blocks the chosen-by-affinity replica held (0 when unmatched)
    hashes: list[int] = field(repr=False, default_factory=list)
    done: bool = False


class PrefixAffinityPolicy:
    """Routing state for replicas numbered 0..n-1. Not thread-safe: call it from one event loop."""

    def __init__(self, num_replicas: int, config: RoutingConfig | None = None):
        if num_replicas < 1:
            raise ValueError("need at least one replica")
        self.config = config or RoutingConfig()
        self.num_replicas = num_replicas
        self.in_flight = [0] * num_replicas
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._rr = 0
        self.counts = {AFFINITY: 0, SPILLED: 0, UNMATCHED: 0}

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def _touch(self, h: int) -> _Block:
        block = self._blocks.get(h)
        if block is None:
            block = self._blocks[h] = _Block()
            if len(self._blocks) > self.config.max_blocks:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(h)
        return block

    def _least_loaded(self, candidates: Sequence[int]) -> int:
        low = min(self.in_flight[r] for r in candidates)
        tied = [r for r in candidates if self.in_flight[r] == low]
        pick = tied[self._rr % len(tied)]
        self._rr += 1
        return pick

    def _specific_matches(self, hashes: list[int], candidates: Sequence[int]) -> list[int]:
        """Per candidate, how many prompt-specific blocks of the longest cached prefix it holds."""
        all_mask = 0
        for r in candidates:
            all_mask |= 1 << r
        matches = [0] * len(candidates)
        alive = list(range(len(candidates)))
        last = len(hashes) - 1
        for i, h in enumerate(hashes):
            block = self._blocks.get(h)
            if block is None:
                break
            # This request branching off the recorded successor makes the block common already.
            common = (block.branches or (block.served & all_mask) == all_mask
                      or (i < last and block.successor is not None and block.successor != hashes[i + 1]))
            still = []
            for i in alive:
                r = candidates[i]
                if (block.served >> r) & 1 or (block.pending and block.pending.get(r)):
                    if not common:
                        matches[i] += 1
                    still.append(i)
            alive = still
            if not alive:
                break
        return matches

    # -- the policy --------------------------------------------------------------------------------------------
    def hashes_for(self, token_ids: Sequence[int], namespace: str) -> list[int]:
        return block_hashes(token_ids, namespace, self.config.block_size)

    def route(self, hashes: list[int], candidates: Sequence[int]) -> Decision:
        """Pick a replica among `candidates` (in service and holding the model) and claim the prompt's blocks."""
        if not candidates:
            raise ValueError("no candidate replica")
        matches = self._specific_matches(hashes, candidates) if hashes else [0] * len(candidates)
        best = max(matches)
        if best == 0:
            decision = Decision(self._least_loaded(candidates), UNMATCHED, 0, hashes)
        else:
            affine = self._least_loaded([r for r, m in zip(candidates, matches) if m == best])
            low = min(self.in_flight[r] for r in candidates)
            if self.in_flight[affine] - low > self.config.spill_threshold:
                decision = Decision(self._least_loaded(candidates), SPILLED, best, hashes)
            else:
                decision = Decision(affine, AFFINITY, best, hashes)
        self.counts[decision.kind] += 1
        self._claim(decision)
        return decision

    def _claim(self, decision: Decision) -> None:
        r = decision.replica
        self.in_flight[r] += 1
        # Touched tail first, so a prompt's root is its most recently used record: the LRU then evicts a chain from
        # its tail, and what is left still matches as a prefix (evicting the root first would orphan the rest).
        hashes = decision.hashes
        blocks = [self._touch(h) for h in reversed(hashes)][::-1]
        for i, block in enumerate(blocks):
            if block.pending is None:
                block.pending = {}
            block.pending[r] = block.pending.get(r, 0) + 1
            if i:
                previous = blocks[i - 1]
                if previous.successor is None:
                    previous.successor = hashes[i]
                elif previous.successor != hashes[i]:
                    previous.branches = True

    def finish(self, decision: Decision, ok: bool) -> None:
        """Release the claim; on success the replica now owns the blocks. Safe to call twice."""
        if decision.done:
            return
        decision.done = True
        r = decision.replica
        self.in_flight[r] -= 1
        for h in decision.hashes:
            block = self._blocks.get(h)
            if block is None:
                continue  # evicted while in flight
            if block.pending:
                left = block.pending.get(r, 0) - 1
                if left > 0:
                    block.pending[r] = left
                else:
                    block.pending.pop(r, None)
            if ok:
                block.served |= 1 << r

    def forget_replica(self, r: int) -> None:
        """Drop everything replica `r` owns (it restarted, so its cache is empty); in-flight claims stay counted."""
        mask = ~(1 << r)
        for block in self._blocks.values():
            block.served &= mask

    def reset_counts(self) -> None:
        self.counts = {AFFINITY: 0, SPILLED: 0, UNMATCHED: 0}

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)
