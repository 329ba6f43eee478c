"""The log-prob contract every head honours: TRL's `ChunkedLogProbFunction.apply` calling convention and its checks.

A head is a callable `(hidden[N,H], weight[V,H], bias[V]|None, targets[N], temperature, chunk_size, softcap,
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


def valid_rows(targets: torch.Tensor) -> torch.Tensor | None:
    """The indices of the rows a head computes (target >= 0: TRL's -100 rows get log-prob 0 and no gradient), or
    None when that is every row."""
    valid = targets >= 0
    return None if bool(valid.all()) else valid.nonzero().squeeze(-1)


def select_rows(rows: torch.Tensor | None, *tensors):
    """Each of `tensors` (per-row, or None) at `rows`; as they are when `rows` is None."""
    return tuple(t if t is None or rows is None else t.index_select(0, rows) for t in tensors)


def scatter_rows(rows: torch.Tensor | None, n: int, *tensors):
    """Each of `tensors` (a value per row of `rows`, or None) back at its place among `n` rows, zeros elsewhere."""
    return tuple(t if t is None or rows is None else t.new_zeros(n).index_copy(0, rows, t) for t in tensors)


def scatter_grad(valid_grad: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The valid rows' input gradient as one for all of `hidden` (zero rows elsewhere), in `hidden`'s dtype."""
    valid_grad = valid_grad.to(hidden.dtype)
    return valid_grad if rows is None else torch.zeros_like(hidden).index_copy_(0, rows, valid_grad)


# --- which head computation a call needs -----------------------------------------------------------------------------
def head_mode(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """`inference` (no gradient will be asked for), `frozen` (only the hidden states need one: PEFT / LoRA, FSDP2 +
    LoRA, `requires_grad=False` heads) or `trainable` (the head's weight or bias needs one).

    Read before `autograd.Function.apply`: inside `forward` grad mode is always off, so a `torch.no_grad()` call
    (old / reference log-probs) cannot be told apart there."""
    if not torch.is_grad_enabled():
        return "inference"
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return "trainable"
    return "frozen" if hidden.requires_grad else "inference"


def outputs_from_stats(run_max, sum_exp, z_sum_exp, sq_sum_exp, z_sum, max_before_target, target_logit, vocab, want):
    """(log Z, log-probs, entropy, (log Σp², mean logit, is_top1)) from a row's online-LSE statistics (max, Σe^(z−max),
    Σe^(z−max)·z, Σe^(2(z−max)), Σz, max before the target, target logit); unwanted outputs are None. The torch and
    Triton paths both end their forward here."""
    log_z = run_max + torch.log(sum_exp)
    entropy = log_z - z_sum_exp / sum_exp if want["entropy"] else None
    extras = (
        torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) if want["log_sum_sq_probs"] else None,
        z_sum / vocab if want["mean_logits"] else None,
        (target_logit >= run_max) & (target_logit > max_before_target) if want["is_top1"] else None,
    )
    return log_z, target_logit - log_z, entropy, extras
