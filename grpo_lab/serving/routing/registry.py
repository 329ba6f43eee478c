"""The routing policies by name: the one list `--routing-policy`, `RouterConfig.routing_policy` and the replay
simulator choose from.

An entry is `"name": "module:Factory"` (the factory takes `(num_replicas, RoutingConfig)`): strings, so a new policy
is one module plus one line here, and the router imports only the policy it runs.
"""

from __future__ import annotations

import importlib

from .policy import RoutingConfig, RoutingPolicy

POLICIES: dict[str, str] = {
    "prefix": ".prefix_affinity:PrefixAffinityPolicy",  # the router's default: longest prompt-specific prefix
    "blog_proxy": ".baselines:BlogProxyPolicy",  # the rule of the proxy published with the HF blog post
    "round_robin": ".baselines:RoundRobinPolicy",  # prompts ignored
}
DEFAULT_POLICY = "prefix"


def check_policy_name(name: str) -> str:
    """`name` if it is registered; otherwise a one-line ValueError listing the names."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}: choose one of {', '.join(POLICIES)}")
    return name


def make_policy(name: str, num_replicas: int, config: RoutingConfig | None = None) -> RoutingPolicy:
    """A new policy `name` for replicas 0..num_replicas-1; TypeError if what is registered is not a RoutingPolicy."""
    module, _, attr = POLICIES[check_policy_name(name)].partition(":")
    factory = getattr(importlib.import_module(module, __package__), attr)
    policy = factory(num_replicas, config or RoutingConfig())
    if not isinstance(policy, RoutingPolicy):
        wanted = [*RoutingPolicy.__annotations__, *(m for m in vars(RoutingPolicy) if not m.startswith("_"))]
        missing = [m for m in wanted if not hasattr(policy, m)]
        raise TypeError(f"routing policy {name!r} ({POLICIES[name]}) is not a RoutingPolicy: it lacks {missing}")
    return policy
