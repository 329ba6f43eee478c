"""Activation memory of one decoder layer in a GRPO step, per token, read off the autograd graph of the code.

Each tensor a Qwen3 / Qwen2 decoder layer saves for its backward (transformers 5's `Qwen3DecoderLayer` on SDPA, PEFT
LoRA linears with `lora_dropout=0`) is listed with its size per token and the backward stage that frees it. The
backward runs the stages in the order of `STAGES`; at each stage the live activations are the tensors not yet freed
plus that stage's transients (the gradients in flight). `tests/memory/test_planner_layer.py` checks every number
here against the bytes a real layer keeps and peaks at on CPU (a storage-counting dispatch mode).

Sizes are bytes per token of the local batch (N = batch × sequence tokens), except the attention probabilities of the
math kernel, which are per token *and* per key position (they scale with N × T).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

# backward order of a decoder layer (the residual adds have no saved tensors)
STAGES = ("down", "act", "gate_up", "post_norm", "o_proj", "attention", "qkv", "input_norm")
FP32 = 4


@dataclass(frozen=True)
class Saved:
    name: str
    bytes_per_token: float
    stage: str  # the backward stage after which it is freed


def saved_tensors(shape: ModelShape, b: int, lora_r: int, targets, kernel: str, seq_len: int,
                  checkpointing: bool = True) -> list[Saved]:
    """What one decoder layer keeps for its backward, per token (`b`: bytes of the model dtype).

    RMSNorm (`x.to(fp32)`, `x * rsqrt(var + eps)`, `weight * h.to(dtype)`) keeps its fp32 input and the [N, 1]
    rsqrt; under LoRA its weight is frozen, so `h` is kept only in full fine-tuning. In fp32 the fp32 "copy" is the
    input itself: the layer input is the checkpoint (nothing extra), the attention residual is kept only by this.
    A linear keeps its input when its weight (full fine-tuning) or its LoRA A needs a gradient; LoRA's B keeps A's
    [N, r] output. SiLU keeps its input, the gate product both factors. The flash kernels keep q, k, v (grouped-query:
    not expanded), the output and the log-sum-exp; the math kernel keeps the scaled q, the scaled k and v expanded to
    every head, and the [heads, T] probabilities of each query.
    """
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    full = lora_r == 0
    lora = set() if full else set(targets)

    def keeps_input(*names):  # a projection's input is saved when its weight or its LoRA A needs a gradient
        return full or any(n in lora for n in names)

    def lora_out(name, stage):
        return [Saved(f"{name}.lora_A_out", lora_r * b, stage)] if name in lora else []

    out: list[Saved] = []
    # input RMSNorm
    if b < FP32 or not checkpointing:
        out.append(Saved("input_norm.x_fp32", FP32 * h, "input_norm"))
    out.append(Saved("input_norm.rsqrt", FP32, "input_norm"))
    if full:
        out.append(Saved("input_norm.h", b * h, "input_norm"))
    # q, k, v projections (+ Qwen3's per-head q/k RMSNorm)
    if keeps_input("q_proj", "k_proj", "v_proj"):
        out.append(Saved("qkv.input", b * h, "qkv"))
    for name in ("q_proj", "k_proj", "v_proj"):
        out += lora_out(name, "qkv")
    if shape.qk_norm:
        out += [Saved("q_norm.x_fp32", FP32 * q, "qkv"), Saved("k_norm.x_fp32", FP32 * kv, "qkv"),
                Saved("qk_norm.rsqrt", FP32 * (shape.heads + shape.kv_heads), "qkv")]
        if full:
            out += [Saved("q_norm.h", b * q, "qkv"), Saved("k_norm.h", b * kv, "qkv")]
    # attention kernel
    if kernel == "math":
        out += [Saved("sdpa_math.q_scaled", b * q, "attention"),
                Saved("sdpa_math.k_scaled_expanded", b * q, "attention"),
                Saved("sdpa_math.v_expanded", b * q, "attention"),
                Saved("sdpa_math.probs", b * shape.heads * seq_len, "attention")]
        if keeps_input("o_proj"):
            out.append(Saved("o_proj.input", b * q, "o_proj"))
    else:  # flash / cuDNN / mem-efficient on CUDA, the flash kernel on CPU
        out += [Saved("sdpa.q", b * q, "attention"), Saved("sdpa.k", b * kv, "attention"),
                Saved("sdpa.v", b * kv, "attention"), Saved("sdpa.out", b * q, "attention"),
                Saved("sdpa.logsumexp", FP32 * shape.heads, "attention")]
    out += lora_out("o_proj", "o_proj")
    # post-attention RMSNorm: its fp32 input (bf16: a copy; fp32: the residual itself, kept only by this)
    out += [Saved("post_norm.x_fp32", FP32 * h, "post_norm"), Saved("post_norm.rsqrt", FP32, "post_norm")]
    if full:
        out.append(Saved("post_norm.h", b * h, "post_norm"))
    # MLP: down(silu(gate(x)) * up(x))
    if keeps_input("gate_proj", "up_proj"):
        out.append(Saved("gate_up.input", b * h, "gate_up"))
    out += lora_out("gate_proj", "gate_up") + lora_out("up_proj", "gate_up")
    out += [Saved("mlp.gate", b * i, "act"), Saved("mlp.silu", b * i, "act"), Saved("mlp.up", b * i, "act")]
    if keeps_input("down_proj"):
        out.append(Saved("down.input", b * i, "down"))
    out += lora_out("down_proj", "down")
    return out


def stage_transient(stage: str, shape: ModelShape, b: int, kernel: str, seq_len: int) -> float:
    """Bytes per token in flight at a backward stage, beyond the saved tensors not yet freed.

    The gradient of the layer's output stays alive until the post-norm branch's gradient is added to it (the
    residual), so every MLP stage carries one [N, H]; the attention stages carry the residual's sum instead.
    `act`: down_proj's input gradient and the two gradients of the gate product (the product's own input is freed).
    `attention` (flash, CUDA): dO, dQ, dK, dV, FlashAttention-2's fp32 dq accumulator and, for grouped-query
    attention, dK and dV expanded to every query head before the reduction. `math`: dO, the probabilities'
    gradient and the softmax's input gradient ([heads, T] each), and dQ, dK, dV at head width.
    `cpu_flash`: the CPU kernel's fp32 accumulators of dQ, dK, dV (per query head) and its outputs.
    """
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    grouped = shape.kv_heads != shape.heads
    if stage == "act":
        return b * h + 3 * b * i
    if stage == "down":
        return b * h + b * i
    if stage != "attention":
        return b * h
    if kernel == "math":
        return b * h + b * q + 2 * b * shape.heads * seq_len + 3 * b * q
    if kernel == "cpu_flash":
        return b * h + b * q + (b * q + 2 * b * kv) + FP32 * 3 * q
    return (b * h + b * q + (b * q + 2 * b * kv) + FP32 * q + FP32 * shape.heads
            + (2 * b * q if grouped else 0))


def backward_levels(saved: list[Saved], shape: ModelShape, b: int, kernel: str, seq_len: int) -> dict[str, float]:
    """Live activation bytes per token of the layer at each backward stage: its saved tensors not freed yet plus
    the stage's transients."""
    levels = {}
    for k, stage in enumerate(STAGES):
        alive = sum(s.bytes_per_token for s in saved if STAGES.index(s.stage) >= k)
        levels[stage] = alive + stage_transient(stage, shape, b, kernel, seq_len)
    return levels
