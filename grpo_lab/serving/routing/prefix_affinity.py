"""Prefix-affinity routing: send a rollout to the replica that already holds its prompt's KV blocks (the rule is
described in docs/serving.md, "Routes by prefix").

GRPO sends G rollouts of one prompt at once, so the win is keeping a group on one replica: its prompt is prefilled
once. Only prompt-specific blocks count (a shared chat template is cached everywhere anyway); unlike the blog post's
proxy, blocks are owned only once the replica answered. Memory is bounded: one packed int per block in an LRU of
`max_blocks` (~145 B a record, `test_record_memory`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .policy import AFFINITY, SPILLED, UNMATCHED, BasePolicy, Decision, RoutingConfig


# A block record is one int: bits 0-31 the fingerprint of the first successor seen (0: none yet), bit 32 "a second,
# different successor was seen" (the block branches: shared template), bits 33+ the bitmask of replicas that answered
# a request containing the block. An int costs far less than an object with slots (see the module docstring).
_SUCCESSOR_MASK = 0xFFFFFFFF
_BRANCHES = 1 << 32
_SERVED_SHIFT = 33


def _fingerprint(h: int) -> int:
    return ((h >> 32) & _SUCCESSOR_MASK) | 1  # never 0, which means "no successor yet"


def _with_successor(record: int, successor: int) -> int:
    """`record` having seen `successor` (a fingerprint) follow its block."""
    recorded = record & _SUCCESSOR_MASK
    if recorded == 0:
        return record | successor
    return record if recorded == successor else record | _BRANCHES


@dataclass(slots=True)
class _Claims:
    """Requests in flight containing one block: per replica, and the successors they named (a packed record)."""

    by_replica: dict[int, int] = field(default_factory=dict)
    record: int = 0  # successor fingerprint and branch bit, as in an LRU record (no served bits)


class AffinityRule(BasePolicy):
    """What every prefix-affinity rule here shares: the walk along the prompt's blocks and the choice between
    affinity, spill and unmatched. Subclasses say who holds a block (`_block`) and what routing records (`claim`)."""

    def _block(self, hashes: list[int], i: int, candidates_mask: int) -> tuple[int, bool] | None:
        """Block `i` of the prompt: the bitmask of replicas holding it, and whether it is common (not
        prompt-specific); None when no replica does."""
        raise NotImplementedError

    def _matches(self, hashes: list[int], candidates: Sequence[int]) -> list[int]:
        """Per candidate, how many prompt-specific blocks of the longest cached prefix it holds."""
        candidates_mask = sum(1 << r for r in set(candidates))
        matches = [0] * len(candidates)
        alive = range(len(candidates))
        for i in range(len(hashes)):
            block = self._block(hashes, i, candidates_mask)
            if block is None:
                break
            holders, common = block
            alive = [j for j in alive if (holders >> candidates[j]) & 1]
            if not alive:
                break
            if not common:
                for j in alive:
                    matches[j] += 1
        return matches

    def choose(self, hashes: list[int], candidates: Sequence[int]) -> Decision:
        """The candidate holding the most prompt-specific blocks, unless it is more than K in flight ahead of the
        least loaded (spill); with no match, the least loaded."""
        matches = self._matches(hashes, candidates) if hashes else [0] * len(candidates)
        best = max(matches)
        if best == 0:
            return Decision(self.least_loaded(candidates), UNMATCHED, 0, hashes)
        affine = self.least_loaded([r for r, m in zip(candidates, matches) if m == best])
        low = min(self.in_flight[r] for r in candidates)
        if self.in_flight[affine] - low > self.config.spill_threshold:
            return Decision(self.least_loaded(candidates), SPILLED, best, hashes)
        return Decision(affine, AFFINITY, best, hashes)


class PrefixAffinityPolicy(AffinityRule):
    """The router's default policy (registered as "prefix"): the rule of the module docstring."""

    def __init__(self, num_replicas: int, config: RoutingConfig | None = None):
        super().__init__(num_replicas, config)
        self._blocks: OrderedDict[int, int] = OrderedDict()  # block hash -> packed record (see _SUCCESSOR_MASK)
        self._pending: dict[int, _Claims] = {}  # block hash -> requests in flight containing it; only while in flight

    def _block(self, hashes: list[int], i: int, candidates_mask: int) -> tuple[int, bool] | None:
        """Held by the replicas that answered it or have a request containing it in flight; common when it branches
        (this request branching off the recorded successor counts) or every candidate answered it."""
        record, claims = self._blocks.get(hashes[i]), self._pending.get(hashes[i])
        if record is None and claims is None:
            return None
        record = record or 0
        served = holders = record >> _SERVED_SHIFT
        if claims is not None:
            holders |= sum(1 << r for r in claims.by_replica)
            if claims.record & _SUCCESSOR_MASK:
                record = _with_successor(record, claims.record & _SUCCESSOR_MASK)
            record |= claims.record & _BRANCHES
        successor = record & _SUCCESSOR_MASK
        common = bool(record & _BRANCHES) or (served & candidates_mask) == candidates_mask or (
            i + 1 < len(hashes) and successor != 0 and successor != _fingerprint(hashes[i + 1]))
        return holders, common

    # -- the policy --------------------------------------------------------------------------------------------
    def claim(self, decision: Decision) -> None:
        """A pending claim on every block: the group's next rollouts follow it; no LRU record until it succeeds."""
        r = decision.replica
        hashes = decision.hashes
        for i, h in enumerate(hashes):
            claims = self._pending.get(h)
            if claims is None:
                claims = self._pending[h] = _Claims()
            claims.by_replica[r] = claims.by_replica.get(r, 0) + 1
            if i + 1 < len(hashes):
                claims.record = _with_successor(claims.record, _fingerprint(hashes[i + 1]))

    def release(self, decision: Decision, ok: bool) -> None:
        """Release the claim; on success the replica now owns the blocks: recorded tail first, so the LRU evicts a
        chain from its tail."""
        r, hashes = decision.replica, decision.hashes
        for h in hashes:
            claims = self._pending.get(h)
            if claims is None:
                continue
            left = claims.by_replica.get(r, 0) - 1
            if left > 0:
                claims.by_replica[r] = left
            else:
                claims.by_replica.pop(r, None)
                if not claims.by_replica:
                    del self._pending[h]
        if not ok:
            return
        blocks, bit = self._blocks, 1 << (_SERVED_SHIFT + r)
        for i in range(len(hashes) - 1, -1, -1):
            record = blocks.pop(hashes[i], 0) | bit
            if i + 1 < len(hashes):
                record = _with_successor(record, _fingerprint(hashes[i + 1]))
            blocks[hashes[i]] = record
            if len(blocks) > self.config.max_blocks:
                blocks.popitem(last=False)

    def forget_replica(self, r: int) -> None:
        """Drop everything replica `r` owns: it restarted (its cache is empty), or it left the router and its number
        may go to a replica that joins later. Only its bit is cleared, so the other replicas keep their blocks and a
        block that only it held stays recorded (with its successor) for whoever serves it next. In-flight claims
        stay counted until their requests finish."""
        bit = 1 << (_SERVED_SHIFT + r)
        mask = ~bit
        blocks = self._blocks
        for h, record in blocks.items():
            if record & bit:
                blocks[h] = record & mask  # assigning an existing key keeps the LRU order

    def owned_blocks(self, r: int) -> int:
        """How many block records say replica `r` holds the block."""
        bit = 1 << (_SERVED_SHIFT + r)
        return sum(1 for record in self._blocks.values() if record & bit)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_pending(self) -> int:
        return len(self._pending)
