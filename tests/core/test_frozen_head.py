"""Inside a real LoRA `GRPOTrainer` step the frozen LM head takes the two-GEMM path by itself.

With PEFT the head's weight has `requires_grad=False`; the `grpo_lab` backend sees that (`base.head_mode`) and runs
the frozen path (A = Σ p·W accumulated in the forward, an elementwise backward) for the training loss, while the
old-policy log-probs, computed without gradient, are statistics only. On this CPU machine that is the chunked torch
path; `tests/kernels/test_fused_kernel_gpu.py` checks the same choice in the Triton kernel on the GPU.
"""

import pytest
import torch
from peft import LoraConfig

import grpo_lab.backends.chunked as chunked
from grpo_lab.trl_glue import GRPOLabConfig, GRPOLabTrainer


@pytest.fixture
def recorded(monkeypatch):
    """The head mode of every grpo_lab call and whether the elementwise frozen backward ran."""
    modes, frozen_backwards = [], []
    real_mode, real_grad = chunked.head_mode, chunked.frozen_input_grad
    monkeypatch.setattr(chunked, "head_mode", lambda *a: modes.append(real_mode(*a)) or modes[-1])
    monkeypatch.setattr(chunked, "frozen_input_grad", lambda *a: frozen_backwards.append(1) or real_grad(*a))
    return modes, frozen_backwards


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-fine-tune"])
def test_the_frozen_path_is_chosen_in_a_lora_training_step(trainer_factory, recorded, lora):
    modes, frozen_backwards = recorded
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM") if lora else None
    trainer = trainer_factory(trainer_cls=GRPOLabTrainer, args_cls=GRPOLabConfig, loss_backend="grpo_lab",
                              max_steps=1, learning_rate=1e-2, num_iterations=2, peft_config=peft_config)
    head = trainer.model.get_output_embeddings()
    assert head.weight.requires_grad is not lora
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    trained = "frozen" if lora else "trainable"
    assert trained in modes and "inference" in modes, modes  # the loss, and the old-policy log-probs
    assert set(modes) == {trained, "inference"}, modes
    assert len(frozen_backwards) == (modes.count("frozen") if lora else 0)
    moved = [n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(before[n], p.detach())]
    assert moved and all(("lora_" in n) for n in moved) is lora, moved
