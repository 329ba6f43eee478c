"""What every log-prob backend shares: TRL's `ChunkedLogProbFunction.apply` calling convention and its checks.

A backend is a callable `(hidden[N,H], weight[V,H], bias[V]|None, targets[N], temperature, chunk_size, softcap,
logit_scale, outputs) -> (logprobs[N] fp32, entropy[N]|None, log_sum_sq_probs|None, mean_logits|None,
is_top1|None)`: exactly what `trl.trainer.utils.add_fused_lm_head` calls, so TRL's loss math runs unchanged on top.
"""

from __future__ import annotations

import torch

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def check_logprob_inputs(hidden, weight, bias, targets, temperature, outputs) -> None:
    """Clear errors for the mistakes a direct caller makes (wrong ranks, widths, dtypes, unknown outputs)."""
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("hidden and weight must be tensors.")
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [N, H] and weight [V, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}.")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden width {hidden.shape[1]} != weight width {weight.shape[1]}.")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets must be [N] with N={hidden.shape[0]}, got {tuple(targets.shape)}.")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] with V={weight.shape[0]}, got {tuple(bias.shape)}.")
    if not temperature or temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    unknown = set(outputs) - {"log_probs", *OPTIONAL_OUTPUTS}
    if unknown:
        raise ValueError(f"Unknown outputs {sorted(unknown)}; known: log_probs, {', '.join(OPTIONAL_OUTPUTS)}.")


def compute_dtype_of(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the projection runs in: autocast's when it is on, else the input's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def transform_logits(y: torch.Tensor, logit_scale: float, softcap: float | None, temperature: float) -> torch.Tensor:
    """Raw projection -> the logits the softmax sees: scale, optional tanh softcap, then temperature."""
    z = y * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature
