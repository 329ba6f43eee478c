"""Model configs and random-init models: the exact public configs shipped in `data/configs/` (Qwen3 0.6B-14B,
Qwen2.5-Math-1.5B) and tiny presets for quick CPU runs.
"""

from __future__ import annotations

import json
from importlib import resources

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

# Tiny configs of the same architectures, for CPU quick mode and tests: the smallest, its untied-head twin, and one
# whose vocabulary is large enough for the logits to matter.
_TINY_QWEN3 = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                   max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_CONFIGS: dict[str, dict] = {
    "tiny-qwen3": _TINY_QWEN3,
    "tiny-qwen3-untied": {**_TINY_QWEN3, "tie_word_embeddings": False},
    "small-qwen3": {**_TINY_QWEN3, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                    "head_dim": 64, "vocab_size": 8192, "max_position_embeddings": 4096},
}


def shipped_model_names() -> list[str]:
    """Names of the exact public configs shipped in `data/configs/`."""
    folder = resources.files("grpo_lab.data_files").joinpath("configs")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def known_model_names() -> list[str]:
    return shipped_model_names() + sorted(TINY_CONFIGS)


def load_model_config(name: str) -> PretrainedConfig:
    """The config for `name`: a shipped exact config ("Qwen3-0.6B" or "Qwen/Qwen3-0.6B") or a tiny preset."""
    short = name.split("/", 1)[1] if name.startswith(("Qwen/", "qwen/")) else name
    if short in TINY_CONFIGS:
        fields = dict(TINY_CONFIGS[short])
    elif short in shipped_model_names():
        text = resources.files("grpo_lab.data_files").joinpath("configs", f"{short}.json").read_text()
        fields = {k: v for k, v in json.loads(text).items() if k not in ("architectures", "torch_dtype")}
    else:
        raise ValueError(f"Unknown model {name!r}. Known offline: {', '.join(known_model_names())}.")
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(name: str, dtype: torch.dtype | str = torch.float32, seed: int = 0, device: str | None = None):
    """A random-init causal LM with the exact shapes of `name` (no weights are downloaded)."""
    if isinstance(dtype, str):
        dtype = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16}[dtype]
    config = load_model_config(name)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
