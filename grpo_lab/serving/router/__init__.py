"""The router: one vLLM-shaped URL in front of N replicas (`python -m grpo_lab.serving.router`).

`server` (the aiohttp proxy and its handlers), `config` (`RouterConfig`), `thread` (`start_router`: the router on a
thread of this process), `replica_pool` (health, ejection, re-admission), `membership` and `admin_api` /
`admin_client` (replicas added and removed at run time), `adapter_lifecycle` (adapter loads and unloads behind the
router). Imports `routing`, `adapters`, `tenancy` and `wire`.
"""
