"""Routing: which replica serves a completion, and what happens when it is slow or fails.

`policy` (the `RoutingPolicy` protocol the router and the simulator call, and `BasePolicy`, its bookkeeping),
`registry` (the policies by name: `--routing-policy`), `prefix_hash` (chained 16-token KV-block hashes seeded with the
adapter name), `prefix_affinity` (the default policy: longest cached prefix, spill threshold, pending claims),
`baselines` (the published proxy's rule and round robin, measured against), `per_try` (the per-try deadline from
observed latency), `forwarding` (one completion's re-sends and hedge).
Imports `wire` only.
"""
