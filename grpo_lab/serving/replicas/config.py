"""Configuration of the CPU replica (transformers + PEFT behind vLLM's HTTP contract)."""

from __future__ import annotations

from dataclasses import dataclass, field

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class CPUReplicaConfig:
    """What the CPU replica serves and how.

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
    served_model_names: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int = 1024
    max_loras: int = 6
    max_lora_rank: int = 16
    block_size: int = 16
    prefix_cache_blocks: int = 4096
    dtype: str = "float32"
    seed: int = 0
    api_key_env: str = "VLLM_API_KEY"
    storage_lag_s: float = 0.0
    torch_threads: int = 1
    adapter_cache_dir: str | None = None

    def __post_init__(self):
        if not self.served_model_names:
            self.served_model_names = [self.model]
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of vLLM's {VLLM_LORA_RANKS}, got {self.max_lora_rank}")
        if self.max_loras < 1 or self.max_model_len < 2 or self.block_size < 1:
            raise ValueError("max_loras >= 1, max_model_len >= 2 and block_size >= 1 are required")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
