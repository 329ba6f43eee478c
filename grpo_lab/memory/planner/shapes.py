"""The shapes the memory planner needs from a decoder-only model config: widths, parameter counts, LoRA sizes.

Memory depends on shapes, not weights, so the exact public configs in `data/configs` are all the planner reads.
Covered: Qwen3 (per-head RMSNorm on q and k, no projection bias), Qwen2 / Qwen2.5 (bias on q, k and v, no q/k norm)
and Llama-style models (neither).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the LM head is the embedding matrix (one Parameter)
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    qkv_bias: bool  # Qwen2: bias on the q, k and v projections

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by its module name."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: the seven projections, their biases, the two RMSNorms (+ q/k norms)."""
        n = sum(a * b for a, b in self.linears().values()) + 2 * self.hidden
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, the untied LM head if any, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.root_params + self.layers * self.layer_params

    def lora_layer_params(self, r: int, targets) -> int:
        """LoRA parameters of one decoder layer: A [r, in] + B [out, r] per targeted projection."""
        return sum(r * (a + b) for name, (a, b) in self.linears().items() if name in targets)

    def down_proj_params(self) -> int:
        return self.intermediate * self.hidden


def shape_of(config) -> ModelShape:
    """A `ModelShape` from a `transformers` config (anything with the usual decoder-only field names)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "")
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(
        hidden=int(text.hidden_size), intermediate=int(text.intermediate_size), layers=int(text.num_hidden_layers),
        heads=heads, kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
        vocab=int(text.vocab_size), tied=bool(getattr(text, "tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        qkv_bias=model_type.startswith("qwen2") or bool(getattr(text, "attention_bias", False)),
    )


def shape_for(model: str, model_config=None) -> ModelShape:
    """The shape of a named model (shipped config or tiny preset), or of `model_config` when given."""
    if model_config is not None:
        return shape_of(model_config)
    from grpo_lab.models import load_model_config

    return shape_of(load_model_config(model))
