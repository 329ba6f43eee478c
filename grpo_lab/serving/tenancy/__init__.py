"""Tenancy: several training runs sharing one pool of replicas.

Its modules are listed in docs/architecture.md. Imports `adapters` and `wire`.
"""
