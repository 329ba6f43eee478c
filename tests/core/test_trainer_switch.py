"""The one-line switch: real `GRPOTrainer.train()` runs per backend, with logged losses that agree."""

import math

import pytest
import torch
from peft import LoraConfig

from grpo_lab.loss.config import GRPOLossConfig
from grpo_lab.loss.trl_switch import GRPOLabConfig, GRPOLabTrainer, logprob_backend, set_loss_backend

BACKENDS = ["trl", "grpo_lab", "naive", "liger"]


def train_losses(trainer_factory, backend, steps=3, **config):
    torch.manual_seed(0)
    trainer = trainer_factory(trainer_cls=GRPOLabTrainer, args_cls=GRPOLabConfig, loss_backend=backend,
                              max_steps=steps, learning_rate=1e-2, temperature=1.0, **config)
    assert trainer.loss_backend == backend
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == steps
    return [entry["loss"] for entry in logs], [entry["reward"] for entry in logs], trainer


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tokenizer_module):
    from trainer_fixtures import make_trainer

    def factory(**config):
        return make_trainer(tmp_path_factory.mktemp("ref"), tokenizer_module, **config)

    return train_losses(factory, "naive", loss_type="grpo", beta=0.0)


@pytest.fixture(scope="module")
def tokenizer_module():
    from grpo_lab.tasks.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.mark.parametrize("backend", ["trl", "grpo_lab", "liger"])
def test_train_logs_agree_across_backends(trainer_factory, reference_run, backend):
    ref_losses, ref_rewards, _ = reference_run
    losses, rewards, _ = train_losses(trainer_factory, backend, loss_type="grpo", beta=0.0)
    assert all(math.isfinite(x) for x in losses)
    # Same seed, same sampling: the rewards (from generations) are identical while the weights agree closely.
    assert rewards[0] == pytest.approx(ref_rewards[0])
    assert losses == pytest.approx(ref_losses, abs=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_peft_lora_model_trains_with_backend(trainer_factory, backend):
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM")
    torch.manual_seed(0)
    trainer = trainer_factory(trainer_cls=GRPOLabTrainer, args_cls=GRPOLabConfig, loss_backend=backend,
                              max_steps=2, learning_rate=1e-2, peft_config=peft_config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = [n for n in before if "lora_B" in n and not torch.equal(before[n], after[n].detach())]
    assert changed, "LoRA weights did not move"


def test_backend_really_is_used(trainer_factory, monkeypatch):
    """The dispatcher sends TRL's fused-head call to the chosen backend, and only inside the trainer's scope."""
    import grpo_lab.loss.heads.chunked as chunked
    import grpo_lab.loss.trl_switch as trl_switch

    calls = []
    original = chunked.ChunkedLogProbFunction.apply
    monkeypatch.setattr(chunked.ChunkedLogProbFunction, "apply", lambda *a: calls.append(1) or original(*a))
    trainer = trainer_factory(trainer_cls=GRPOLabTrainer, args_cls=GRPOLabConfig, loss_backend="grpo_lab",
                              max_steps=1)
    lookups = []  # the name was checked and its head found when the backend was set: a step does neither

    def counted(real):
        return lambda *a, **k: lookups.append(a) or real(*a, **k)

    for name in ("resolve_backend", "logprob_head"):
        monkeypatch.setattr(trl_switch, name, counted(getattr(trl_switch, name)))
    trainer.train()
    assert calls, "grpo_lab backend was not called during training"
    assert lookups == []
    n = len(calls)
    ids = torch.tensor([[5, 6, 7, 8]])
    trainer.model(input_ids=ids, labels=ids, fused_lm_head=True)  # outside the trainer: TRL's own function
    assert len(calls) == n
    with logprob_backend("grpo_lab"):
        trainer.model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert len(calls) == n + 1


def test_switch_on_an_existing_trainer_and_back(trainer_factory):
    trainer = trainer_factory(max_steps=1)
    set_loss_backend(trainer, "naive")
    assert trainer.loss_backend == "naive" and hasattr(trainer.compute_loss, "_grpo_lab_original")
    set_loss_backend(trainer, "trl")
    assert "compute_loss" not in trainer.__dict__
    with pytest.raises(ValueError, match="Unknown loss_backend"):
        set_loss_backend(trainer, "cuda")


def test_unknown_backend_in_config(tmp_path):
    with pytest.raises(ValueError, match="Unknown loss_backend 'fast'"):
        GRPOLabConfig(output_dir=str(tmp_path), loss_backend="fast", report_to=[], use_cpu=True, bf16=False)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(entropy_coef=0.01), "entropy bonus"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(loss_type="luspo"), "luspo"),
    ],
)
def test_liger_refuses_what_it_cannot_express(trainer_factory, config, match):
    with pytest.raises(ValueError, match=match):
        trainer_factory(trainer_cls=GRPOLabTrainer, args_cls=GRPOLabConfig, loss_backend="liger", **config)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_liger_compute_loss_matches_trl(trainer_factory, loss_type):
    from test_loss_vs_trl import grads_of, make_inputs

    trainer = trainer_factory(loss_type=loss_type, beta=0.05, epsilon_high=0.28, temperature=0.9)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = make_inputs(trainer, 1, with_ref=True, config=GRPOLossConfig.from_trl_args(trainer.args))
    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, dict(inputs))
    trl_loss.backward()
    trl_grads = grads_of(trainer.model)
    set_loss_backend(trainer, "liger")
    trainer.model.zero_grad()
    liger_loss = trainer._compute_loss(trainer.model, dict(inputs))
    liger_loss.backward()
    torch.testing.assert_close(liger_loss.detach(), trl_loss.detach(), atol=1e-5, rtol=1e-4)
    for name, grad in grads_of(trainer.model).items():
        torch.testing.assert_close(grad, trl_grads[name], atol=1e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04), "beta != 0"),
        (dict(loss_type="cispo", importance_sampling_level="sequence"), "sequence-level"),
        (dict(loss_type="sapo", importance_sampling_level="sequence"), "sequence-level"),
    ],
)
def test_liger_refuses_more_it_cannot_express(trainer_factory, config, match):
    with pytest.raises(ValueError, match=match):
        trainer_factory(trainer_cls=GRPOLabTrainer, args_cls=GRPOLabConfig, loss_backend="liger", **config)


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 2.0), ("logit_scale", 0.5),
                                          ("logits_scaling", 4.0)])
def test_liger_refuses_a_head_with_a_logit_transform_and_a_failed_switch_changes_nothing(trainer_factory, field,
                                                                                          value):
    """Liger projects with the plain weight: a softcapped or scaled head would train on another loss. The refusal
    comes before the trainer is touched, so it keeps its backend."""
    trainer = trainer_factory(max_steps=1)
    set_loss_backend(trainer, "naive")
    setattr(trainer.model.config, field, value)
    with pytest.raises(ValueError, match="logit transform"):
        set_loss_backend(trainer, "liger")
    assert trainer.loss_backend == "naive" and hasattr(trainer.compute_loss, "_grpo_lab_original")
    assert "_compute_loss" not in trainer.__dict__
