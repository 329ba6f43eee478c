"""grpo_lab.serving: several inference replicas behind one URL for TRL's AsyncGRPOTrainer (see docs/serving.md).

One idea per module; importing this package loads none of them (the CPU replica pulls in torch, the router only
aiohttp):

- `prefix_hash`: chained KV-block hashes of a prompt, seeded with the adapter name (vLLM's prefix-cache rule)
- `routing_policy`: prefix affinity with the common-prefix rule, spill threshold and pending claims
- `router_config`, `router`: the aiohttp proxy (`python -m grpo_lab.serving.router`, `start_router(...)`)
- `replica_pool`, `adapter_fanout`, `upstream`, `metrics`: health and re-admission, all-or-nothing adapter loads,
  authenticated upstream calls, Prometheus text
- `replica_config`, `generation`, `prefix_kv_cache`, `cpu_replica`: the CPU replica
  (`python -m grpo_lab.serving.cpu_replica`), `processes`: start replicas as subprocesses, `local_cluster`:
  N CPU replicas + a router in one call (notebooks)
- `vllm_launcher`: the `vllm serve` command line and environment for GPU replicas
- `trace`, `routing_sim`, `fake_replica`: GRPO traces, the replay simulator and a fake replica for benchmarks
"""
