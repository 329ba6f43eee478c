"""GRPOLossConfig rejects what TRL rejects, with the same meaning, and reads its fields from a GRPOConfig."""

import pytest
import torch
from trl import GRPOConfig

from grpo_lab.loss.config import GRPOLossConfig
from grpo_lab.loss.reference import grpo_loss

REJECTED_BY_BOTH = [
    (dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.0), "must be less than"),
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=None,
          vllm_importance_sampling_clip_max=None), "At least one of"),
]


@pytest.mark.parametrize("fields, match", REJECTED_BY_BOTH)
def test_rejected_like_trl(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **fields)
    with pytest.raises(ValueError, match=match):
        GRPOLossConfig(**fields)


def test_vespo_with_sequence_vllm_is_rejected_like_trl(trainer_factory):
    with pytest.raises(ValueError, match="VESPO loss requires"):
        trainer_factory(loss_type="vespo", use_vllm=True, vllm_mode="colocate",
                        vllm_importance_sampling_mode="sequence_mask")
    with pytest.raises(ValueError, match="VESPO loss requires"):
        GRPOLossConfig(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask").check_vllm_compatible()


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(loss_type="ppo"), "Unknown loss_type 'ppo'"),
        (dict(importance_sampling_level="batch"), "importance_sampling_level"),
        (dict(vllm_importance_sampling_mode="clip"), "vllm_importance_sampling_mode"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
        (dict(top_entropy_quantile=-0.1), "top_entropy_quantile"),
        (dict(temperature=0.0), "temperature"),
    ],
)
def test_values_trl_only_fails_on_later_are_rejected_up_front(fields, match):
    with pytest.raises(ValueError, match=match):
        GRPOLossConfig(**fields)


def test_from_trl_args_copies_the_loss_fields(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, loss_type="grpo",
                      epsilon_high=0.28, beta=0.04, delta=1.5, top_entropy_quantile=0.2, max_completion_length=99)
    cfg = GRPOLossConfig.from_trl_args(args)
    assert (cfg.loss_type, cfg.epsilon_high_value, cfg.beta, cfg.delta, cfg.top_entropy_quantile,
            cfg.max_completion_length) == ("grpo", 0.28, 0.04, 1.5, 0.2, 99)
    assert GRPOLossConfig(epsilon=0.3).epsilon_high_value == 0.3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(per_token_logps=torch.zeros(4)), r"\(B, T\)"),
        (dict(completion_mask=torch.ones(2, 5)), "completion_mask shape"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(config=GRPOLossConfig(beta=0.1)), "ref_per_token_logps"),
        (dict(config=GRPOLossConfig(loss_type="dapo"), num_items_in_batch=None), "num_items_in_batch"),
        (dict(config=GRPOLossConfig(entropy_coef=0.1)), "entropies"),
        (dict(config={"loss_type": "grpo"}), "GRPOLossConfig"),
    ],
)
def test_grpo_loss_bad_input(kwargs, match):
    base = dict(per_token_logps=torch.zeros(2, 4), completion_mask=torch.ones(2, 4), advantages=torch.zeros(2),
                config=GRPOLossConfig(loss_type="grpo"), num_items_in_batch=8)
    base.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        grpo_loss(base.pop("per_token_logps"), base.pop("completion_mask"), base.pop("advantages"),
                  base.pop("config"), **base)


def test_defaults_are_trls():
    """Every field shared with TRL's GRPOConfig has TRL's default (a loss built directly equals the trainer's)."""
    import dataclasses

    from trl import GRPOConfig

    trl_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(GRPOLossConfig)}
    shared = sorted(set(trl_defaults) & set(ours))
    assert len(shared) >= 15, shared
    assert {k: ours[k] for k in shared} == {k: trl_defaults[k] for k in shared}
    assert GRPOLossConfig(top_entropy_quantile=0.0).top_entropy_quantile == 0.0  # TRL's range is [0, 1]
