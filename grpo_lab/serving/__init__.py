"""grpo_lab.serving: several inference replicas behind one URL for TRL's AsyncGRPOTrainer (see docs/serving.md).

Layer 2 of grpo_lab (docs/architecture.md): it imports `grpo_lab.models` and `grpo_lab.lab` only. One idea per
module; importing this package loads none of them (the CPU replica pulls in torch, the router only aiohttp):

- routing: `prefix_hash` (chained KV-block hashes seeded with the adapter name, vLLM's prefix-cache rule),
  `routing_policy` (prefix affinity with the common-prefix rule, spill threshold and pending claims),
  `routing_baselines` (the published proxy's rule, for comparison)
- the router: `router_config`, `router` (the aiohttp proxy, `python -m grpo_lab.serving.router`), `router_thread`
  (`start_router(...)`: the router in this process), `vllm_routes` (the vLLM endpoints both servers register),
  `completion_batches` (a batch prompt split and merged as vLLM does), `replica_pool` (health and re-admission),
  `upstream` (authenticated upstream calls), `metrics` (Prometheus text), `forwarding` and `per_try` (a
  completion's re-sends and its hedge after a per-try deadline), `client_watch` (a completion whose client hung up
  is cancelled), `membership`, `admin_api`, `admin_client`
  (replicas added and removed at run time)
- runs sharing the replicas: `tenancy` (each run's namespace, token, adapter slots and lease), `fair_queue` (whose
  completion goes next: weighted fair sharing under a per-replica cap), `tenant_api` (`/router/runs` and the vLLM
  endpoints as each run sees them)
- adapters: `adapter_lifecycle` (loads and unloads behind the router), `adapter_fanout` (all-or-nothing loads),
  `adapter_drain` (unload once in-flight rollouts finish), `adapter_slots` (how many `--max-loras` a
  `max_staleness` needs), `storage` (atomic adapter publishing with manifests, read by the replicas),
  `adapter_cache` (a replica's verified local copies), `adapter_sidecar` (in front of vLLM: loads fsspec URLs by
  local path)
- replicas: `replica_config`, `generation`, `prefix_kv_cache`, `cpu_replica` (the CPU replica,
  `python -m grpo_lab.serving.cpu_replica`), `vllm_spec` (a real vLLM replica's command line and environment),
  `replica_processes` (CPU and vLLM replicas as child processes), `vllm_launcher` (the `vllm serve` lines),
  `local_cluster` (N CPU replicas + a router in one call, for notebooks), `ray_actor`, `ray_replicas`,
  `ray_cluster` (replicas as Ray actors over a cluster's nodes)
- offline tools: `trace`, `routing_sim`, `fake_replica` (GRPO traces, the replay simulator, a fake replica for
  benchmarks)
"""
