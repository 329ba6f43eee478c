"""Replicas: the servers that generate, and the processes that run them.

`cpu_replica` (transformers + PEFT behind vLLM's HTTP contract) with `config`, `generation`, `prefix_kv_cache`;
`vllm_spec` / `vllm_launcher` (real vLLM), `processes` (watched child processes), `fake_replica` (sleeps, for
benchmarks). Imports `adapters`, `routing.prefix_hash` and `wire`.
"""
