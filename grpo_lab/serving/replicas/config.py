"""Configuration of the CPU replica (transformers + PEFT behind vLLM's HTTP contract)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo_lab.lab.settings import Range, check_fields, setting

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class CPUReplicaConfig:
    """What the CPU replica serves and how: `python -m grpo_lab.serving.replicas.cpu_replica`'s flags are generated from
    these fields (`lab.settings_parser`; each entry below is its flag's help).

    Args:
        model: a `grpo_lab.models` name ("tiny-qwen3", a shipped exact config: random init) or a local directory
            with a saved transformers model.
        served_model_names: names requests may use for the base model; the first is the one reported. Add
            "trl-policy-v0" so AsyncGRPOTrainer's first rollouts (before any sync) reach the base model.
        host, port: listen address; port 0 picks a free one (printed as `READY <port>` on stdout).
        max_model_len: cap on prompt + completion tokens.
        max_loras: adapters held at once (AsyncGRPOTrainer needs max_staleness + 2).
        max_lora_rank: largest adapter rank accepted; one of vLLM's ranks.
        block_size: KV block size reported in `cache_config` and used for prefix-cache hashing.
        prefix_cache_blocks: prefix-cache capacity in blocks (0 disables it).
        dtype: "float32" or "bfloat16".
        seed: seed of the random-init weights.
        api_key_env: environment variable with the bearer token required on all but `/health` and `/metrics`;
            unset or empty means no authentication.
        storage_lag_s: fault injection for tests: an adapter directory counts as invisible ("No adapter found")
            until this many seconds after the first load request for it, like a lagging shared mount.
        torch_threads: intra-op threads for torch (keep 1 when several replicas share a small CPU).
        adapter_cache_dir: where adapters published on an object store (`lora_path` an `s3://`, `gs://`, `hf://`
            URL) are copied before loading (`adapters.cache.AdapterCache`); None: a temporary folder of the replica.
    """

    model: str = "tiny-qwen3"
    served_model_names: list[str] = setting(list, flag="served-model-name", nargs="+")
    host: str = "127.0.0.1"
    port: int = setting(0, check=Range(0, high=65535))
    max_model_len: int = setting(1024, check=Range(2))
    max_loras: int = setting(6, check=Range(1))
    max_lora_rank: int = setting(16, choices=VLLM_LORA_RANKS)
    block_size: int = setting(16, check=Range(1))
    prefix_cache_blocks: int = setting(4096, check=Range(0))
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    api_key_env: str = "VLLM_API_KEY"
    storage_lag_s: float = setting(0.0, check=Range(0))
    torch_threads: int = setting(1, check=Range(1))
    adapter_cache_dir: str | None = None

    def __post_init__(self):
        if not self.served_model_names:
            self.served_model_names = [self.model]
        check_fields(self)
