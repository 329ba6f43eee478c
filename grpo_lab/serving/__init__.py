"""grpo_lab.serving: several inference replicas behind one URL for TRL's AsyncGRPOTrainer (see docs/serving.md).

Layer 2 of grpo_lab (docs/architecture.md): it imports `grpo_lab.models` and `grpo_lab.lab` only. Inside, one room a
concern, listed in docs/architecture.md; a room imports only rooms below it (tests/core/test_architecture.py checks),
and importing this package loads none of them (the CPU replica pulls in torch, the router only aiohttp).
"""
