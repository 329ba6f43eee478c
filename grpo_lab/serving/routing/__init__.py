"""Routing: which replica serves a completion, and what happens when it is slow or fails.

Its modules are listed in docs/architecture.md. Imports `wire` only.
"""
