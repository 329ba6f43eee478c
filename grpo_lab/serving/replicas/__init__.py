"""Replicas: the servers that generate, and the processes that run them.

`config`, `generation`, `prefix_kv_cache`, `cpu_replica` (the CPU replica: transformers + PEFT behind vLLM's HTTP
contract, `python -m grpo_lab.serving.replicas.cpu_replica`), `vllm_spec` (a real vLLM replica's command line and
environment), `processes` (CPU and vLLM replicas as watched child processes), `vllm_launcher` (the `vllm serve`
lines), `fake_replica` (a replica that only sleeps, for benchmarks). Imports `adapters`, `routing.prefix_hash`
and `wire`.
"""
