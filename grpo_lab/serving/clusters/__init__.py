"""Clusters: replicas plus a router started together, on this machine or placed over a Ray cluster.

`local` (`LocalCluster`: N CPU replicas + a router in one call), `ray_actor`, `ray_replicas`, `ray_cluster`
(replicas as Ray actors over a cluster's nodes, restarted by Ray). The top room: imports `router` and `replicas`.
"""
