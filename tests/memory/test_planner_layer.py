"""The planner's per-layer terms against the bytes a real decoder layer keeps and peaks at (CPU, exact counting)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from grpo_lab.memory.live_bytes import LiveTensorBytes
from grpo_lab.memory.planner.config import LORA_TARGETS
from grpo_lab.memory.planner.layer import backward_levels, saved_tensors
from grpo_lab.memory.planner.shapes import shape_of


def _layer(arch, hidden, heads, kv_heads, intermediate, lora_r, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=heads,
              num_key_value_heads=kv_heads, vocab_size=512, max_position_embeddings=1024)
    if arch == "qwen3":
        kw["head_dim"] = 64
    config = AutoConfig.for_model(arch, **kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear"),
                               autocast_adapter_dtype=False).get_base_model()
    return config, model


def measure_layer(arch="qwen3", hidden=256, heads=8, kv_heads=2, intermediate=768, lora_r=16, dtype=torch.float32,
                  seq=128, batch=2, kernel="cpu_flash", checkpointing=True):
    """(bytes per token the layer keeps after its forward, peak bytes per token in its backward) — the backward
    peak counted as in a training step: the layer's input and the incoming gradient are alive, its output is not."""
    config, model = _layer(arch, hidden, heads, kv_heads, intermediate, lora_r, dtype)
    layer = model.model.layers[0]
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(seq)[None].expand(batch, seq))

    def fn(h):
        out = layer(h, position_embeddings=(cos, sin), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    tokens = batch * seq
    live = LiveTensorBytes()
    backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
    with live, sdpa_kernel([backend]):
        y = checkpoint(fn, x, use_reentrant=False) if checkpointing else fn(x)
        grad = torch.randn_like(y)
        out_bytes = y.untyped_storage().nbytes()
        kept = live.current - out_bytes - grad.untyped_storage().nbytes()
        live.reset_peak()
        start = live.current - out_bytes
        y.backward(grad)
        peak = live.peak - out_bytes
    return config, kept / tokens, (peak - start + grad.untyped_storage().nbytes()) / tokens


CASES = [
    dict(),  # fp32 LoRA
    dict(dtype=torch.bfloat16),
    dict(lora_r=0),  # full fine-tuning: norms keep their normalised input, the down projection's weight grad exists
    dict(dtype=torch.bfloat16, lora_r=0),
    dict(intermediate=1024, lora_r=64),
    dict(arch="qwen2", heads=4, kv_heads=2),  # q/k/v bias, no q/k norm
    dict(kernel="math", seq=256),  # the composite SDPA: [heads, T] probabilities per token
    dict(heads=16, kv_heads=2),  # wide attention: the CPU flash backward's accumulators set the peak
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "fp32-lora")
def test_layer_backward_peak_matches_the_planner(case):
    kw = dict(case)
    config, _, measured = measure_layer(**kw)
    dtype = kw.get("dtype", torch.float32)
    b = torch.empty((), dtype=dtype).element_size()
    kernel, seq, lora_r = kw.get("kernel", "cpu_flash"), kw.get("seq", 128), kw.get("lora_r", 16)
    shape = shape_of(config)
    saved = saved_tensors(shape, b, lora_r, LORA_TARGETS, kernel, seq)
    predicted = max(backward_levels(saved, shape, b, kernel, seq).values())
    if lora_r == 0:  # the down projection's weight gradient (a per-layer size, here spread over the tokens)
        predicted += b * shape.down_proj_params() / (2 * seq)
    assert predicted == pytest.approx(measured, rel=0.06)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora_r", [0, 16])
def test_saved_tensors_without_checkpointing_match_the_planner(dtype, lora_r):
    config, kept, _ = measure_layer(dtype=dtype, lora_r=lora_r, checkpointing=False)
    b = torch.empty((), dtype=dtype).element_size()
    shape = shape_of(config)
    saved = sum(s.bytes_per_token for s in saved_tensors(shape, b, lora_r, LORA_TARGETS, "cpu_flash", 128, False))
    # the layer input (created before counting) is what fp32's input norm keeps, and cos / sin are the model's
    if dtype == torch.float32:
        saved -= 4 * shape.hidden
    assert saved == pytest.approx(kept, rel=0.01)


def test_checkpointed_layer_keeps_nothing_after_its_forward():
    _, kept, _ = measure_layer()
    assert kept == 0
