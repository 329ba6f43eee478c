"""The router: one vLLM-shaped URL in front of N replicas (`python -m grpo_lab.serving.router`).

Its modules are listed in docs/architecture.md. Imports `routing`, `adapters`, `tenancy` and `wire`.
"""
