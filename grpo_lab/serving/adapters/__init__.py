"""Adapters: publishing LoRA versions, copying them to replicas, loading them all-or-nothing, draining them out.

Its modules are listed in docs/architecture.md. Imports `wire` only.
"""
