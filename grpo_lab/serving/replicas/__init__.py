"""Replicas: the servers that generate, and the processes that run them.

Its modules are listed in docs/architecture.md. Imports `adapters`, `routing.prefix_hash` and `wire`.
"""
