"""The wire: what crosses HTTP between the trainer, the router and the replicas, and nothing about routing.

Its modules are listed in docs/architecture.md. Imports no other room.
"""
