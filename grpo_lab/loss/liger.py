"""The `liger` backend: Liger-Kernel's `LigerFusedLinearGRPOLoss` in place of `GRPOTrainer._compute_loss`.

Liger fuses the LM head and the loss on the last hidden state (the way TRL's removed `use_liger_loss` did), so the
trainer's whole `_compute_loss` is replaced. Options Liger cannot express raise a `ValueError` up front instead of
training on a silently different loss.
"""

from __future__ import annotations

import torch

from ..lab.install import install_hint
from .config import GRPOLossConfig


def _liger_loss_class():
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ImportError(f"loss_backend='liger' needs liger-kernel: {install_hint('liger')}") from err
    return LigerFusedLinearGRPOLoss


def unsupported_liger_options(config: GRPOLossConfig, *, use_adaptive_entropy: bool = False) -> list[str]:
    """The options set in `config` that Liger 0.8.5's GRPO loss does not compute (empty if none)."""
    problems = []
    if config.entropy_coef != 0.0 or use_adaptive_entropy:
        problems.append("the entropy bonus (entropy_coef / use_adaptive_entropy): Liger computes no entropy")
    if config.top_entropy_quantile < 1.0:
        problems.append("top_entropy_quantile < 1: Liger computes no entropy to mask on")
    if config.off_policy_mask_threshold is not None:
        problems.append("off_policy_mask_threshold: Liger has no off-policy sequence mask")
    if config.loss_type == "luspo" and config.importance_sampling_level == "token":
        problems.append("loss_type='luspo' with token-level importance sampling: Liger's luspo normaliser is the "
                        "sequence-level one")
    if config.loss_type == "luspo" and config.beta != 0.0:
        problems.append("loss_type='luspo' with beta != 0: Liger normalises the KL term differently")
    if config.importance_sampling_level == "sequence" and config.loss_type in ("cispo", "sapo", "vespo"):
        problems.append(f"loss_type={config.loss_type!r} with sequence-level importance sampling: Liger refuses it")
    return problems


def head_logit_transform(model) -> tuple[float | None, float]:
    """(softcap, logit scale) the model's LM head applies to its logits, read from the text config under the names
    TRL 1.16's fused head reads (final_logit_softcapping; logit_scale, output_multiplier, lm_head_multiplier, or
    logits_scaling, a divisor except on HyperCLOVA X)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = next((getattr(config, k) for k in ("logit_scale", "output_multiplier", "lm_head_multiplier")
                  if getattr(config, k, None) is not None), None)
    divisor = getattr(config, "logits_scaling", None)
    if scale is None and divisor is not None:
        scale = divisor if getattr(config, "model_type", "") == "hyperclovax" else 1 / divisor
    return softcap, 1.0 if scale is None else float(scale)


def check_liger_supports(trainer) -> None:
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        raise ValueError(f"loss_backend='liger' works with GRPOTrainer only, not {type(trainer).__name__}.")
    _liger_loss_class()
    config = GRPOLossConfig.from_trl_args(trainer.args)
    problems = unsupported_liger_options(config, use_adaptive_entropy=getattr(trainer.args, "use_adaptive_entropy",
                                                                              False))
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append("the MoE router aux loss")
    softcap, scale = head_logit_transform(trainer.model)
    if softcap is not None or scale != 1.0:  # Liger's loss projects with the plain weight (and bias) only
        problems.append(f"the model's logit transform (final_logit_softcapping={softcap}, logit scale {scale:g})")
    if problems:
        raise ValueError("loss_backend='liger' cannot express: " + "; ".join(problems) + ". Use 'grpo_lab' instead.")


def make_liger_loss(config: GRPOLossConfig, compiled: bool = False):
    """A `LigerFusedLinearGRPOLoss` configured with TRL's semantics for `config` (not Liger's own defaults)."""
    same_name = ("beta", "loss_type", "max_completion_length", "importance_sampling_level", "temperature", "delta",
                 "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                 "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")  # Liger's argument = the config's field
    return _liger_loss_class()(compiled=compiled, use_ref_model=config.beta != 0.0, epsilon_low=config.epsilon_low,
                               epsilon_high=config.epsilon_high_value, **{k: getattr(config, k) for k in same_name})


def _last_hidden_state(model, input_ids, attention_mask, logits_to_keep):
    """The backbone's hidden states that predict the completion tokens, without computing any logits."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, base.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, :-1][:, -logits_to_keep:], base.get_output_embeddings()


def liger_compute_loss(trainer, model, inputs):
    """`GRPOTrainer._compute_loss` with Liger's fused linear GRPO loss (same normalisers as TRL 1.16)."""
    liger_loss = getattr(trainer, "_grpo_lab_liger_loss", None)
    if liger_loss is None:  # built once: the trainer's loss options do not change during training
        liger_loss = make_liger_loss(GRPOLossConfig.from_trl_args(trainer.args),
                                     compiled=trainer.accelerator.device.type == "cuda")
        trainer._grpo_lab_liger_loss = liger_loss
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    unwrapped = trainer.accelerator.unwrap_model(model)
    with trainer.accelerator.autocast():
        hidden, head = _last_hidden_state(unwrapped, input_ids, attention_mask, completion_ids.size(1))
    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    num_items = inputs.get("num_items_in_batch")
    if num_items is not None and mode == "train":
        num_items = num_items * accumulation / trainer.args.steps_per_generation
    is_ratio = inputs.get("importance_sampling_ratio") if (
        trainer.use_vllm and trainer.vllm_importance_sampling_correction) else None
    loss, metrics = liger_loss(
        _input=hidden, lin_weight=head.weight, selected_token_ids=completion_ids, attention_mask=mask,
        advantages=inputs["advantages"], bias=head.bias, old_per_token_logps=inputs.get("old_per_token_logps"),
        ref_per_token_logps=inputs.get("ref_per_token_logps"), vllm_is_ratio=is_ratio,
        num_items_in_batch=num_items,
    )
    if liger_loss.loss_type not in ("dapo", "cispo", "vespo"):
        loss = loss / accumulation  # TRL scales these for gradient accumulation; Liger does not
    if liger_loss.beta != 0.0:
        trainer._metrics[mode]["kl"].append(trainer.accelerator.gather(metrics[0]).mean().item())
    trainer._metrics[mode]["clip_ratio/region_mean"].append(trainer.accelerator.gather(metrics[-1]).mean().item())
    return loss
