"""Inside a real LoRA `GRPOTrainer` step the frozen LM head takes the two-GEMM path by itself.

With PEFT the head's weight has `requires_grad=False`; the `grpo_lab` backend sees that (`base.head_mode`) and runs
the frozen path (A = Σ p·W accumulated in the forward, an elementwise backward) for the training loss, while the
old-policy log-probs, computed without gradient, are statistics only. On this CPU machine that is the chunked torch
path; `tests/kernels/test_fused_kernel_gpu.py` checks the same choice in the Triton kernel on the GPU.
"""

import pytest
import torch
from peft import LoraConfig

import grpo_lab.loss.heads.chunked as chunked
from grpo_lab.loss.trl_switch import GRPOLabConfig, GRPOLabTrainer


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


def loss_parity(trainer, device: str) -> dict:
    """TRL's own `_compute_loss` on one batch with the `naive` head and with the `grpo_lab` head of a LoRA trainer:
    {backend: (loss, LoRA gradients, logged metrics)}. Shared with the GPU test of the Triton frozen path."""
    from grpo_lab.loss.trl_switch import set_loss_backend

    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    gen = torch.Generator().manual_seed(0)
    b, p, t = 4, 5, 8
    vocab = model.config.vocab_size
    completion_mask = (torch.arange(t)[None] < torch.tensor([t, 5, 3, 7])[:, None]).long()
    inputs = dict(prompt_ids=torch.randint(5, vocab, (b, p), generator=gen),
                  prompt_mask=torch.ones(b, p, dtype=torch.long),
                  completion_ids=torch.randint(5, vocab, (b, t), generator=gen), completion_mask=completion_mask,
                  advantages=torch.randn(b, generator=gen), num_items_in_batch=completion_mask.sum() * 2.0,
                  old_per_token_logps=torch.randn(b, t, generator=gen) * 0.1 - 4.0,
                  ref_per_token_logps=torch.randn(b, t, generator=gen) * 0.1 - 4.0)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    results = {}
    for backend in ("naive", "grpo_lab"):
        set_loss_backend(trainer, backend)
        model.zero_grad()
        loss = trainer._compute_loss(model, dict(inputs))
        loss.backward()
        grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
        results[backend] = (loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()})
    return results


def assert_parity(results: dict, tol: float) -> None:
    (ref_loss, ref_grads, ref_metrics), (loss, grads, metrics) = results["naive"], results["grpo_lab"]
    assert grads.keys() == ref_grads.keys() and grads and all("lora_" in n for n in grads)
    assert abs(loss.item() - ref_loss.item()) <= tol * max(1.0, abs(ref_loss.item()))
    for name in grads:
        err = ((grads[name] - ref_grads[name]).double().norm() / ref_grads[name].double().norm().clamp(min=1e-30))
        assert err.item() < tol, (name, err.item())
    for key in ("entropy", "kl"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=tol, abs=1e-6), key


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_through_trl_on_the_frozen_path(trainer_factory, recorded, loss_type):
    """TRL's loss (with KL, so the reference term is there too) on the frozen path equals it on the naive head."""
    modes, frozen_backwards = recorded
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trainer_factory(loss_type=loss_type, beta=0.04, epsilon_high=0.28, temperature=0.9,
                              peft_config=peft_config)
    assert_parity(loss_parity(trainer, "cpu"), 1e-5)
    assert modes == ["frozen"] and frozen_backwards == [1]
