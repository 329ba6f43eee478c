"""The one reference implementation of the GRPO loss math (TRL 1.16 semantics), on per-token log-probs.

Every backend produces `(B, T)` log-probs (and entropies); this module turns them into the loss and TRL's metrics.
It is tested against TRL's own `GRPOTrainer._compute_loss` on a real trainer, so any backend that matches the
`naive` log-probs trains exactly like TRL. Single process: the metrics are local means (TRL all-reduces them),
computed on the device and read on the host only when someone reads one (`LazyMetrics`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from .config import GRPOLossConfig


class LazyMetrics(Mapping):
    """TRL's metric names -> floats, held as 0-dim tensors until a value is read.

    Reading a CUDA value (`.item()`) makes the host wait for every kernel queued before it; the loss runs mid-step, so
    reading its metrics there would leave the GPU idle while the host then queues the backward. A value is read (and
    kept) only when someone reads it; `tensors()` gives the raw tensors to accumulate or gather on the device.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None):
        self._tensors = dict(tensors or {})
        self._floats: dict[str, float] = {}
        cuda = next((t.device for t in self._tensors.values() if t.is_cuda), None)
        # the stream that computed them: a read from another stream must still come after those kernels
        self._stream = None if cuda is None else torch.cuda.current_stream(cuda)

    def __getitem__(self, key: str) -> float:
        if key not in self._floats:
            value = self._tensors[key]
            if self._stream is not None:
                self._stream.synchronize()
            self._floats[key] = value.item()
        return self._floats[key]

    def __contains__(self, key) -> bool:  # Mapping's would read the value
        return key in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The metrics as 0-dim tensors on the loss's device (reading none of them)."""
        return dict(self._tensors)

    def __repr__(self) -> str:
        return f"LazyMetrics({dict(self)!r})"


@dataclass
class GRPOLossOutput:
    """`loss` is what `backward()` is called on (already scaled for gradient accumulation, like TRL's). `metrics`
    reads as a dict of floats; its values are computed on the device and read only when looked at."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    metrics: LazyMetrics = field(default_factory=LazyMetrics)


def vllm_importance_sampling_ratio(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                                   mask: torch.Tensor, config: GRPOLossConfig) -> torch.Tensor:
    """Truncated or masked IS ratio between the trainer's and the sampler's log-probs: (B, T) for `token_*` modes,
    (B, 1) for `sequence_*` modes. Tokens the sampler could not score (NaN) get ratio 1."""
    diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    if config.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if config.vllm_importance_sampling_mode.endswith("_truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    outside = (ratio < (-math.inf if lo is None else lo)) | (ratio > (math.inf if hi is None else hi))
    return ratio.masked_fill(outside, 0.0)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Tokens whose entropy is at or above the `quantile` of the valid tokens' entropies (none if no token is valid or
    a valid entropy is NaN)."""
    valid = mask.bool()
    if entropies.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    return ((entropies * mask.float()) >= valid_quantile(entropies, valid, quantile)) & valid


def valid_quantile(x: torch.Tensor, valid: torch.Tensor, quantile: float) -> torch.Tensor:
    """`torch.quantile(x[valid].float(), quantile)` bit for bit, as a (1,) tensor (NaN if nothing is valid), without
    boolean indexing, whose result size the host would wait for, and without `torch.quantile`'s 2**24-value limit:
    all values are sorted, the invalid ones as +inf, and the valid count's linear interpolation is read off."""
    ranked = x.float().masked_fill(~valid, math.inf).flatten().sort().values
    q = torch.full((1,), quantile, dtype=ranked.dtype, device=ranked.device)
    rank = (q * (valid.sum() - 1)).clamp(min=0)  # in float32, as torch.quantile computes it
    below, above = rank.long(), rank.ceil().long()
    value = ranked.gather(0, below).lerp(ranked.gather(0, above), rank - below)
    return torch.where((x.isnan() & valid).any(), math.nan, value)  # torch.quantile's NaN propagation


def off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask, threshold) -> torch.Tensor:
    """(B, 1): keep a sequence if its advantage is non-negative or its mean KL(sampler ‖ policy) is small."""
    kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


@torch.no_grad()
def vespo_gamma_weights(advantages, log_ratio, mask, importance_sampling_ratio, config: GRPOLossConfig):
    """phi(w) = exp(lambda + k log w - lambda w) of the sequence IS weight w (a detached gradient scale)."""
    floor = math.log(1e-8)
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        seq_log_ratio = seq_log_ratio + torch.clamp(torch.log(importance_sampling_ratio), floor, 20.0).sum(
            dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, floor, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
    lam = torch.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:  # one value per sequence (sequence-level importance sampling)
        return x.sum() / max(x.shape[0], 1)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _seq_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)


def grpo_loss(
    per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    config: GRPOLossConfig,
    *,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
    entropy_coef: float | None = None,
    training: bool = True,
) -> GRPOLossOutput:
    """The GRPO-family loss of TRL 1.16 `GRPOTrainer._compute_loss`, from per-token log-probs.

    Shapes: `per_token_logps`, `completion_mask` (tool masks folded in), `old/ref/sampling_per_token_logps`,
    `entropies`: (B, T); `advantages`: (B,) or (B, T); `importance_sampling_ratio`: the vLLM IS ratio, (B, T) or
    (B, 1), applied when given and `config.vllm_importance_sampling_correction`. `num_items_in_batch` is the number of
    completion tokens in the whole generation batch (dapo/cispo/vespo). `entropy_coef` overrides the config's (TRL's
    adaptive controller passes the coefficient in force). Without `old_per_token_logps` the step is on-policy.
    """
    coef = getattr(config, "entropy_coef", 0.0) if entropy_coef is None else entropy_coef
    _check_inputs(per_token_logps, completion_mask, advantages, config, old_per_token_logps, ref_per_token_logps,
                  entropies, importance_sampling_ratio, num_items_in_batch, coef)
    mask = completion_mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    eps_low, eps_high = config.epsilon_low, config.epsilon_high_value
    entropy_mask = None
    if config.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(entropies, mask, 1 - config.top_entropy_quantile)

    log_ratio = per_token_logps - old
    if config.importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)

    if config.beta != 0.0:
        ref_diff = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(ref_diff) - ref_diff - 1
        if config.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if config.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * advantages * per_token_logps
    elif config.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if config.delta is not None:  # TRL clamps coef_1 itself, so its clip metrics below see the clamped ratio
            coef_1 = torch.clamp(coef_1, max=config.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif config.loss_type == "sapo":
        temps = torch.where(advantages > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * advantages
    else:  # vespo
        phi_seq = vespo_gamma_weights(advantages, log_ratio, mask, importance_sampling_ratio, config)
        per_token_loss = -phi_seq * advantages * per_token_logps

    if config.off_policy_mask_threshold is not None:
        sampling = old if sampling_per_token_logps is None else sampling_per_token_logps
        per_token_loss = per_token_loss * off_policy_sequence_mask(
            advantages, per_token_logps, sampling, mask, config.off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if (importance_sampling_ratio is not None and config.vllm_importance_sampling_correction
            and config.loss_type != "vespo"):
        per_token_loss = per_token_loss * importance_sampling_ratio
    if config.beta != 0.0:
        per_token_loss = per_token_loss + config.beta * per_token_kl

    accumulation = gradient_accumulation_steps if training else 1.0
    if config.loss_type in ("cispo", "dapo", "vespo"):  # normalised by the whole generation batch's tokens
        n_items = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else torch.full(
            (), float(num_items_in_batch), device=per_token_loss.device)  # made there: a host copy would wait
        normalizer = n_items.to(per_token_loss.device).clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        loss = policy_loss = (per_token_loss * mask).sum() / normalizer
    else:  # normalised within the micro-batch, then scaled for gradient accumulation
        if config.loss_type in ("grpo", "sapo"):
            policy_loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif config.loss_type == "bnpo":
            policy_loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        elif config.loss_type == "dr_grpo":
            policy_loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * config.max_completion_length)
        else:  # luspo
            policy_loss = (per_token_loss * mask).sum(-1).mean()
        loss = policy_loss / accumulation
    policy_loss = policy_loss.detach()

    metrics: dict[str, torch.Tensor] = {}  # 0-dim tensors: nothing here reads a value on the host
    if coef != 0.0:
        effective = mask if entropy_mask is None else mask * entropy_mask
        mean_entropy = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
        loss = loss - coef * mean_entropy
        metrics["policy_loss"] = policy_loss

    with torch.no_grad():
        if config.beta != 0.0:
            metrics["kl"] = _masked_mean(per_token_kl, mask)
        if entropies is not None:
            metrics["entropy"] = _masked_mean(entropies, mask)
        if config.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            low = ((coef_1 < 1 - eps_low) & (advantages < 0)).float()
            high = ((coef_1 > 1 + eps_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
            metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
            metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
            metrics["clip_ratio/low_min"] = _nan_reduce(_seq_means(low, mask), torch.min)
            metrics["clip_ratio/high_max"] = _nan_reduce(_seq_means(high, mask), torch.max)
        elif config.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = _masked_mean(((coef_1 > eps_high) & (advantages > 0)).float(), mask)
        elif config.loss_type == "vespo":
            metrics["vespo/phi_seq_mean"] = _masked_mean(phi_seq, mask)
    return GRPOLossOutput(loss=loss, policy_loss=policy_loss, metrics=LazyMetrics(metrics))


_NAN_REDUCE_FILL = {torch.min: math.inf, torch.max: -math.inf}  # the value that never wins the reduction


def _nan_reduce(x: torch.Tensor, reduce) -> torch.Tensor:
    """`reduce` (torch.min or torch.max) over the non-NaN values of `x`, NaN if there are none, without reading
    anything on the host (dropping the NaNs by boolean indexing would wait for their count)."""
    if x.numel() == 0:
        return x.new_full((), math.nan)
    nan = torch.isnan(x)
    return torch.where(nan.all(), math.nan, reduce(x.masked_fill(nan, _NAN_REDUCE_FILL[reduce])))


def _check_inputs(logps, mask, advantages, config, old, ref, entropies, is_ratio, num_items, entropy_coef):
    if not isinstance(config, GRPOLossConfig):
        raise TypeError(f"config must be a GRPOLossConfig, got {type(config).__name__}.")
    if logps.dim() != 2:
        raise ValueError(f"per_token_logps must be (B, T), got shape {tuple(logps.shape)}.")
    if mask.shape != logps.shape:
        raise ValueError(f"completion_mask shape {tuple(mask.shape)} != per_token_logps shape {tuple(logps.shape)}.")
    if advantages.shape not in ((logps.shape[0],), tuple(logps.shape)):
        raise ValueError(f"advantages must be (B,) or (B, T) with B={logps.shape[0]}, got {tuple(advantages.shape)}.")
    for name, t in (("old_per_token_logps", old), ("ref_per_token_logps", ref), ("entropies", entropies)):
        if t is not None and t.shape != logps.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != per_token_logps shape {tuple(logps.shape)}.")
    if is_ratio is not None and is_ratio.shape not in (tuple(logps.shape), (logps.shape[0], 1)):
        raise ValueError(f"importance_sampling_ratio must be (B, T) or (B, 1), got {tuple(is_ratio.shape)}.")
    if config.beta != 0.0 and ref is None:
        raise ValueError("beta != 0 needs ref_per_token_logps.")
    if (config.top_entropy_quantile < 1.0 or entropy_coef != 0.0) and entropies is None:
        raise ValueError("top_entropy_quantile < 1 and the entropy bonus need entropies.")
    if config.loss_type in ("cispo", "dapo", "vespo") and num_items is None:
        raise ValueError(f"loss_type={config.loss_type!r} normalises by num_items_in_batch; pass it.")
