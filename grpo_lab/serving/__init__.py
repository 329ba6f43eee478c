"""grpo_lab.serving: several inference replicas behind one URL for TRL's AsyncGRPOTrainer (see docs/serving.md).

Layer 2 of grpo_lab (docs/architecture.md): it imports `grpo_lab.models` and `grpo_lab.lab` only. Inside, one room a
concern; a room imports only rooms below it (tests/core/test_architecture.py checks), and importing this package
loads none of them (the CPU replica pulls in torch, the router only aiohttp):

    clusters                      replicas + a router started together (local processes or Ray actors)
    router                        the proxy, its config, replica pool, membership, adapter lifecycle
    tenancy   replicas   sim      runs sharing a pool; the CPU / vLLM replicas and their processes; offline tools
    routing   adapters            which replica serves a completion; publishing and loading adapters
    wire                          HTTP to replicas, vLLM's routes, batches, metrics, hung-up clients
"""
