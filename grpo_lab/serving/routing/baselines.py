"""Baselines the router's policy is measured against in the replay (`routing_sim`); served only when chosen
(`--routing-policy blog_proxy` or `round_robin`).

`BlogProxyPolicy` is the rule of the proxy of the Hugging Face blog post "Async GRPO with LoRA across HF Jobs" as that
proxy applies it: ownership and successors recorded when it routes, before the replica answers, and the request
being routed not counted as a successor (so it "matches" on template blocks alone, which saves no prefill).
`RoundRobinPolicy` sends each request to the next candidate in turn: the "no prefix routing" line.
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

    def _block(self, hashes: list[int], i: int, candidates_mask: int) -> tuple[int, bool] | None:
        """Held by the replicas routed to; common when every replica (not only the candidates) was, or it branches."""
        served = self._served.get(hashes[i])
        if served is None:
            return None
        return served, served == (1 << self.num_replicas) - 1 or hashes[i] in self._branches

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
    """Each request to the next candidate in turn (registered as "round_robin"): the base's turn counter, which
    `least_loaded` uses only to break ties, is the whole rule here."""

    def choose(self, hashes: list[int], candidates: Sequence[int]) -> Decision:
        pick = candidates[self._rr % len(candidates)]
        self._rr += 1
        return Decision(pick)
