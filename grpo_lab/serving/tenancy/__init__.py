"""Tenancy: several training runs sharing one pool of replicas.

`runs` (each run's adapter namespace, token digest, share of adapter slots and lease), `fair_queue` (whose
completion goes next: weighted fair queuing per run), `tenant_api` (`/router/runs`, who is calling, leases),
`views` (what a caller sees: the Router's handlers ask a request's view, a run's or the whole pool's). Imports
`adapters` and `wire`.
"""
