"""Baselines the router's policy is measured against in the replay (`routing_sim`); served only when chosen
(`--routing-policy blog_proxy` or `round_robin`).

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

`RoundRobinPolicy` sends each request to the next candidate in turn, prompts ignored: the "no prefix routing" line.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .policy import BasePolicy, Decision, RoutingConfig
from .prefix_affinity import AffinityRule


class BlogProxyPolicy(AffinityRule):
    """The published proxy's rule as a `RoutingPolicy` (registered as "blog_proxy")."""

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

    def claim(self, decision: Decision) -> None:
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

    def forget_replica(self, r: int) -> None:
        mask = ~(1 << r)
        for h, served in self._served.items():
            self._served[h] = served & mask  # assigning an existing key keeps the LRU order

    @property
    def num_blocks(self) -> int:
        return len(self._served)


class RoundRobinPolicy(BasePolicy):
    """Each request to the next candidate in turn (registered as "round_robin")."""

    def __init__(self, num_replicas: int, config: RoutingConfig | None = None):
        super().__init__(num_replicas, config)
        self._turn = 0

    def choose(self, hashes: list[int], candidates: Sequence[int]) -> Decision:
        pick = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(pick)
