"""Clusters: replicas plus a router started together, on this machine or placed over a Ray cluster.

One `launcher`; `local` and `ray_cluster` name it for local processes and Ray actors. The top room: imports
`router` and `replicas`.
"""
