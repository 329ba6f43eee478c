"""The wire: what crosses HTTP between the trainer, the router and the replicas, and nothing about routing.

`upstream` (authenticated calls to a replica, the bearer token never logged), `vllm_routes` (the vLLM endpoints TRL
uses, as data, and vLLM's error answer), `completion_batches` (a batch prompt split and merged as vLLM does),
`metrics` (Prometheus text), `client_watch` (a completion whose client hung up is cancelled), `app_thread` (an
aiohttp app on its own event loop in a daemon thread: the in-process router and sidecar). Imports no other room.
"""
