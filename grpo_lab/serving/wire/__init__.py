"""The wire: what crosses HTTP between the trainer, the router and the replicas, and nothing about routing.

`upstream` (authenticated calls to a replica), `vllm_routes`, `completion_batches`, `metrics` (Prometheus text),
`client_watch` (hung-up clients), `app_thread` (an aiohttp app in a daemon thread). Imports no other room.
"""
