"""The reference loss equals TRL's own `GRPOTrainer._compute_loss`, called on a real tiny trainer.

TRL's method runs its fused LM head on the model; the reference runs on log-probs from the `naive` backend of the
same model. Loss, gradients of every parameter and the logged metrics must agree.
"""

import pytest
import torch

from grpo_lab.loss.config import LOSS_TYPES, GRPOLossConfig
from grpo_lab.loss.heads import logprob_head
from grpo_lab.loss.reference import grpo_loss, vllm_importance_sampling_ratio

B, P, T = 4, 5, 8


def make_inputs(trainer, seed, with_ref=False, with_vllm=False, config=None):
    gen = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(5, vocab, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_ids = torch.randint(5, vocab, (B, T), generator=gen)
    lengths = torch.tensor([T, 5, 3, 7])
    completion_mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    with torch.no_grad():
        logps, _ = per_token_logps_and_entropies(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.randn(B, generator=gen),
                  old_per_token_logps=logps + 0.3 * torch.randn(B, T, generator=gen),
                  num_items_in_batch=completion_mask.sum() * 2.0)
    if with_ref:
        inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(B, T, generator=gen)
    if with_vllm:
        inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + 0.05 * torch.randn(B, T, generator=gen)
        inputs["importance_sampling_ratio"] = vllm_importance_sampling_ratio(
            inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], completion_mask, config)
    return inputs


def per_token_logps_and_entropies(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask):
    model = trainer.model
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1][:, -T:]
    head = model.get_output_embeddings()
    lp, ent, *_ = logprob_head("naive")(hidden.reshape(-1, hidden.size(-1)), head.weight, head.bias,
                                                completion_ids.reshape(-1), trainer.temperature, None, None, 1.0,
                                                ("log_probs", "entropy"))
    return lp.view(B, T), ent.view(B, T)


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(trainer_factory, seed=0, accumulation=1, use_vllm=False, edit_inputs=None, **config):
    trainer = trainer_factory(temperature=0.9, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    cfg = GRPOLossConfig.from_trl_args(trainer.args)
    inputs = make_inputs(trainer, seed, with_ref=cfg.beta != 0, with_vllm=use_vllm, config=cfg)
    if edit_inputs is not None:
        edit_inputs(inputs)
    trainer.use_vllm = use_vllm
    if use_vllm:
        trainer.vllm_importance_sampling_correction = True

    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, dict(inputs))
    trl_loss.backward()
    trl_grads = grads_of(trainer.model)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    trainer.model.zero_grad()
    logps, ents = per_token_logps_and_entropies(trainer, inputs["prompt_ids"], inputs["prompt_mask"],
                                                inputs["completion_ids"], inputs["completion_mask"])
    out = grpo_loss(logps, inputs["completion_mask"], inputs["advantages"], cfg,
                    old_per_token_logps=inputs["old_per_token_logps"],
                    ref_per_token_logps=inputs.get("ref_per_token_logps"), entropies=ents,
                    importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                    sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
                    num_items_in_batch=inputs["num_items_in_batch"], gradient_accumulation_steps=accumulation,
                    steps_per_generation=trainer.args.steps_per_generation)
    out.loss.backward()
    ours = grads_of(trainer.model)

    torch.testing.assert_close(out.loss.detach(), trl_loss.detach(), atol=1e-6, rtol=1e-5)
    assert trl_grads.keys() == ours.keys() and len(ours) > 0
    for name in ours:
        torch.testing.assert_close(ours[name], trl_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    for key, value in out.metrics.items():
        assert key in trl_metrics, key
        assert value == pytest.approx(trl_metrics[key], abs=1e-6, nan_ok=True), key
    assert abs(trl_loss.item()) > 0  # the comparison is not vacuous
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_and_level(trainer_factory, loss_type, level):
    compare(trainer_factory, loss_type=loss_type, importance_sampling_level=level, epsilon_high=0.28)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_kl_with_and_without_bias_correction(trainer_factory, loss_type, bias_correction):
    out = compare(trainer_factory, loss_type=loss_type, beta=0.1, use_bias_correction_kl=bias_correction)
    assert out.metrics["kl"] > 0


def test_two_sided_clipping_delta(trainer_factory):
    compare(trainer_factory, loss_type="grpo", delta=1.05)

    def far_off_policy(inputs):  # ratios ~e^0.8 with positive advantages: above 1 + epsilon, clamped by delta
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 0.8
        inputs["advantages"] = inputs["advantages"].abs()

    out = compare(trainer_factory, loss_type="grpo", delta=1.05, edit_inputs=far_off_policy)
    assert out.metrics["clip_ratio/high_mean"] == 0.0  # TRL's metric sees the clamped ratio, 1.05 < 1.2


VLLM_CASES = [(mode, "dapo") for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")]
VLLM_CASES += [("token_truncate", "vespo"), ("token_mask", "vespo")]  # TRL rejects VESPO with sequence-level IS


@pytest.mark.parametrize("mode, loss_type", VLLM_CASES)
def test_vllm_importance_sampling_modes(trainer_factory, mode, loss_type):
    compare(trainer_factory, use_vllm=True, loss_type=loss_type, vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1)


def test_entropy_mask(trainer_factory):
    compare(trainer_factory, loss_type="dapo", top_entropy_quantile=0.5)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus(trainer_factory, loss_type):
    out = compare(trainer_factory, loss_type=loss_type, entropy_coef=0.05, top_entropy_quantile=0.7)
    assert "policy_loss" in out.metrics


def test_off_policy_mask(trainer_factory):
    compare(trainer_factory, loss_type="dapo", off_policy_mask_threshold=0.01, use_vllm=True)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_gradient_accumulation_scaling(trainer_factory, loss_type):
    compare(trainer_factory, accumulation=2, loss_type=loss_type, gradient_accumulation_steps=2)


def test_vllm_ratio_modes_behave():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    sampling = torch.tensor([[0.0, -1.5, -2.0]])
    mask = torch.ones(1, 3)
    cfg = GRPOLossConfig(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.5)
    assert vllm_importance_sampling_ratio(old, sampling, mask, cfg).tolist() == [[1.0, 0.0, 1.0]]
    cfg = GRPOLossConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.5)
    assert vllm_importance_sampling_ratio(old, sampling, mask, cfg)[0, 1].item() == pytest.approx(1.5)
    cfg = GRPOLossConfig(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=9.0)
    assert vllm_importance_sampling_ratio(old, sampling, mask, cfg).shape == (1, 1)
