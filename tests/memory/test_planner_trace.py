"""The planner against whole real TRL GRPO steps on CPU, tensor bytes counted exactly (no RSS noise): every backend,
LoRA and full fine-tuning, tied and untied heads, with and without activation checkpointing."""

import pytest

from grpo_lab.memory.live_bytes import traced_step_peak
from grpo_lab.memory.planner import PlannerConfig, plan
from grpo_lab.memory.spec import PointSpec

CASES = [
    # model, backend, dtype, batch, lora_r, prompt, completion, checkpointing
    ("small-qwen3", "trl", "fp32", 4, 8, 16, 48, True),  # TRL's [4096, 32768] tile buffer dominates on CPU
    ("small-qwen3", "naive", "bf16", 4, 0, 16, 48, True),  # full fine-tuning, the [N, V] logits
    ("small-qwen3", "grpo_lab", "fp32", 4, 8, 16, 240, True),  # frozen head, several token tiles
    ("tiny-qwen3-untied", "grpo_lab", "fp32", 8, 0, 16, 112, True),  # trainable untied head
    ("tiny-qwen3", "liger", "bf16", 8, 4, 16, 112, True),
    ("small-qwen3", "liger", "fp32", 4, 8, 16, 240, False),  # every layer's activations kept
]


@pytest.mark.parametrize("model, backend, dtype, batch, lora_r, prompt, completion, ckpt", CASES,
                         ids=lambda v: str(v))
def test_planner_predicts_the_traced_step_peak(model, backend, dtype, batch, lora_r, prompt, completion, ckpt):
    kw = dict(model=model, loss_backend=backend, dtype=dtype, batch_size=batch, lora_r=lora_r, prompt_len=prompt,
              completion_len=completion)
    measured = traced_step_peak(PointSpec(**kw, steps=2, device="cpu"), gradient_checkpointing=ckpt)
    predicted = plan(PlannerConfig(**kw, device="cpu", gradient_checkpointing=ckpt))
    total = measured["peak_bytes"] + measured["setup_bytes"]
    assert predicted.tensor_peak_bytes() == pytest.approx(total, rel=0.05), predicted.summary()
