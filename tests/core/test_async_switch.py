"""The switch on TRL's `AsyncGRPOTrainer`: its own `compute_loss` gives the same loss and gradients per backend.

The whole loop runs in `tests/async_loop`; here TRL's real `AsyncGRPOTrainer.compute_loss` is called on one packed
row (plain sdpa attention, identical for every backend) with just the trainer state that method reads, so each
backend is compared on exactly the same inputs.
"""

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from grpo_lab.loss.trl_switch import set_loss_backend
from grpo_lab.tasks.tiny import build_char_tokenizer, build_tiny_model

from trainer_fixtures import TINY


def async_trainer(model):
    """An AsyncGRPOLabTrainer holding exactly the state `compute_loss` reads (no server, no rollout worker)."""
    from grpo_lab.async_loop.trainer import loss_only_trainer

    return loss_only_trainer("cpu", epsilon_low=0.2, epsilon_high=0.28, gradient_accumulation_steps=2)


def packed_row(vocab, seed=0):
    """Two completions packed in one row: prompt (3) + completion (5), prompt (2) + completion (4)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [(3, 5), (2, 4)]
    ids, pos, labels, seg = [], [], [], []
    for s, (p, c) in enumerate(lengths):
        seq = torch.randint(4, vocab, (p + c,), generator=gen)
        ids.append(seq)
        pos.append(torch.arange(p + c))
        lab = torch.full((p + c,), -100)
        lab[p - 1:p + c - 1] = seq[p:]
        labels.append(lab)
        seg += [s] * c
    ids, pos, labels = torch.cat(ids), torch.cat(pos), torch.cat(labels)
    token_index = (labels != -100).nonzero().squeeze(-1)
    n = token_index.numel()
    return {
        "input_ids": ids[None], "position_ids": pos[None], "shift_labels": labels[None],
        "attention_mask": torch.ones(1, ids.numel(), dtype=torch.long), "token_index": token_index[None],
        "old_log_probs": torch.full((1, n), -3.0) + 0.5 * torch.randn(1, n, generator=gen),
        "advantages": torch.tensor([[1.0] * 5 + [-0.5] * 4]), "segment_id": torch.tensor([seg]),
        "tree_kv_index": torch.arange(ids.numel())[None], "tree_cu_seqlens_q": torch.tensor([[0, ids.numel()]]),
        "tree_cu_seqlens_k": torch.tensor([[0, ids.numel()]]), "tree_max_seqlens": torch.tensor([[ids.numel()] * 2]),
        "global_n_tokens": torch.tensor([float(n)]), "global_n_forward_tokens": torch.tensor([float(ids.numel())]),
        "mean_seq_len": torch.tensor([ids.numel() / 2.0]),
    }


def loss_and_grads(backend):
    torch.manual_seed(0)
    model = build_tiny_model(build_char_tokenizer(), TINY, seed=0)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    trainer = set_loss_backend(async_trainer(model), backend)
    loss = trainer.compute_loss(model, packed_row(model.config.vocab_size))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, trainer._metrics["train"]


@pytest.mark.parametrize("backend", ["grpo_lab", "naive"])
def test_async_compute_loss_matches_trl_head(backend):
    ref_loss, ref_grads, ref_metrics = loss_and_grads("trl")
    loss, grads, metrics = loss_and_grads(backend)
    assert ref_loss.abs() > 0
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert metrics["entropy"][-1] == pytest.approx(ref_metrics["entropy"][-1], abs=1e-5)


def test_async_backend_is_really_called(monkeypatch):
    import grpo_lab.loss.heads.chunked as chunked

    calls = []
    original = chunked.ChunkedLogProbFunction.apply
    monkeypatch.setattr(chunked.ChunkedLogProbFunction, "apply", lambda *a: calls.append(1) or original(*a))
    loss_and_grads("grpo_lab")
    assert calls


def test_async_config_refuses_liger(tmp_path):
    from grpo_lab.async_loop.config import AsyncGRPOLabConfig

    with pytest.raises(ValueError, match="not available with AsyncGRPOTrainer"):
        AsyncGRPOLabConfig(output_dir=str(tmp_path), loss_backend="liger", report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="Unknown loss_backend"):
        AsyncGRPOLabConfig(output_dir=str(tmp_path), loss_backend="x", report_to=[], use_cpu=True, bf16=False)
    assert AsyncGRPOLabConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False).loss_backend == \
        "grpo_lab"


def test_set_liger_on_async_trainer_is_refused():
    model = build_tiny_model(build_char_tokenizer(), TINY)
    with pytest.raises(ValueError, match="GRPOTrainer only"):
        set_loss_backend(async_trainer(model), "liger")
