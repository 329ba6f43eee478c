"""Baselines the router's policy is measured against in the replay (`routing_sim`); never used to serve.

`BlogProxyPolicy` is the routing rule of the proxy published with the Hugging Face blog post "Async GRPO with LoRA
across HF Jobs" (huggingface.co/blog/asyncgrpo-lora-hfjobs), as that proxy applies it: the same chained block hashes
seeded with the adapter name, a block is *common* once every replica has served it or once more than one successor
has been *recorded* after it, the replica with the most prompt-specific blocks of the longest matched prefix wins unless it
is more than K in flight ahead of the least loaded (spill), and otherwise the least loaded with round-robin ties.
Unlike `PrefixAffinityPolicy` it records ownership (and successors) when it routes, before the replica answers, and
the request being routed does not count as a successor. That last point is why it reports fewer "unmatched"
requests with 4-8 replicas: the second prompt under each new adapter version still sees the template block with a
single recorded successor, so it "matches" the replica that served the first prompt on template blocks alone, which
every replica can serve from its own cache anyway (no prefill saved).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .prefix_affinity import AffinityRule, Decision, RoutingConfig


class BlogProxyPolicy(AffinityRule):
    """Same interface as `PrefixAffinityPolicy` (`route`, `finish`, `counts`, `in_flight`)."""

    def __init__(self, num_replicas: int, config: RoutingConfig | None = None):
        super().__init__(num_replicas, config)
        self._served: OrderedDict[int, int] = OrderedDict()  # block -> bitmask of replicas routed to
        self._successor: dict[int, int] = {}  # block -> first successor recorded
        self._branches: set[int] = set()  # blocks with a second, different successor recorded

    def _matches(self, hashes: list[int], candidates: Sequence[int]) -> list[int]:
        everyone = (1 << self.num_replicas) - 1
        matches = [0] * len(candidates)
        alive = list(range(len(candidates)))
        for h in hashes:
            served = self._served.get(h)
            if served is None:
                break
            common = served == everyone or h in self._branches
            alive = [j for j in alive if (served >> candidates[j]) & 1]
            for j in alive:
                if not common:
                    matches[j] += 1
            if not alive:
                break
        return matches

    def _claim(self, decision: Decision) -> None:
        """Ownership and successors at routing time, as the published proxy does."""
        hashes, r = decision.hashes, decision.replica
        for i, h in enumerate(hashes):
            self._served[h] = self._served.pop(h, 0) | (1 << r)
            if i + 1 < len(hashes):
                first = self._successor.setdefault(h, hashes[i + 1])
                if first != hashes[i + 1]:
                    self._branches.add(h)
        while len(self._served) > self.config.max_blocks:
            old, _ = self._served.popitem(last=False)
            self._successor.pop(old, None)
            self._branches.discard(old)

    def finish(self, decision: Decision, ok: bool) -> None:
        if not decision.done:
            decision.done = True
            self.in_flight[decision.replica] -= 1
