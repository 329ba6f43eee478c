"""Tenancy: several training runs sharing one pool of replicas.

`runs` (each run's adapter namespace, token digest, share of adapter slots and lease), `fair_queue` (whose
completion goes next: weighted fair queuing per run), `tenant_api` (`/router/runs` and the vLLM endpoints as each
run sees them). Imports `adapters` and `wire`.
"""
