"""Adapters: publishing LoRA versions, copying them to replicas, loading them all-or-nothing, draining them out.

`slots` (how many adapter slots a `max_staleness` needs), `storage` (atomic publishing with manifests, any fsspec
URL), `cache` (a replica's verified local copies), `fanout` (one call to every replica, loads rolled back on a
failure), `drain` (an unloaded adapter leaves once its rollouts finish), `sidecar` (in front of a vLLM server: loads
fsspec URLs by local path). Imports `wire` only.
"""
