"""What every log-prob backend shares: TRL's `ChunkedLogProbFunction.apply` calling convention and its checks.

A backend is a callable `(hidden[N,H], weight[V,H], bias[V]|None, targets[N], temperature, chunk_size, softcap,
logit_scale, outputs) -> (logprobs[N] fp32, entropy[N]|None, log_sum_sq_probs|None, mean_logits|None,
is_top1|None)`: exactly what `trl.trainer.utils.add_fused_lm_head` calls, so TRL's loss math runs unchanged on top.
"""

from __future__ import annotations

import contextlib
import contextvars

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


# --- which head computation a call needs -----------------------------------------------------------------------------

HEAD_MODES = ("inference", "frozen", "trainable")


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


# Whether a frozen-head call will get an entropy gradient (an entropy bonus in the loss). The frozen path accumulates
# the Σ p·log p·W term in its forward only when it expects one; without it, a backward that does get an entropy
# gradient still computes it exactly, with one recomputation of the logits. None (the default) = expect what the last
# frozen-head backward saw; `expect_entropy_grad(flag)` sets it for a block of code.
_ENTROPY_GRAD: contextvars.ContextVar = contextvars.ContextVar("grpo_lab_entropy_grad", default=None)
_ENTROPY_GRAD_SEEN = [False]


@contextlib.contextmanager
def expect_entropy_grad(flag: bool = True):
    """Inside this block, frozen-head calls do (flag=True) or do not (False) prepare the entropy gradient."""
    token = _ENTROPY_GRAD.set(bool(flag))
    try:
        yield
    finally:
        _ENTROPY_GRAD.reset(token)


def entropy_grad_expected() -> bool:
    forced = _ENTROPY_GRAD.get()
    return _ENTROPY_GRAD_SEEN[0] if forced is None else forced


def note_entropy_grad(seen: bool) -> None:
    """Called by a frozen-head backward: what the next forward expects when nothing is forced."""
    _ENTROPY_GRAD_SEEN[0] = bool(seen)


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


def frozen_coefficients(g, h, logprobs, entropy, c_target, scale):
    """Per-row (coef_y, coef_a, coef_b) of the frozen head's input gradient coef_y·W_y + coef_a·A + coef_b·B (see
    `frozen_input_grad`): 1 − p_y as −expm1(log p_y), exact when p_y → 1. g / h: fp32 [N] or None."""
    zero = torch.zeros_like(logprobs)
    g = zero if g is None else g
    h = zero if h is None else h
    coef_y = -torch.expm1(logprobs) * g
    coef_a = -g
    if entropy is not None:
        coef_y = coef_y - h * torch.exp(logprobs) * (logprobs + entropy)
        coef_a = coef_a - h * entropy
    return coef_y * c_target * scale, coef_a * scale, -h * scale


def frozen_input_grad(acc_p, acc_plogp, weight_rows, g, h, logprobs, entropy, c_target, scale, out):
    """dX of a frozen head from the vectors its forward accumulated, elementwise (no GEMM).

    With dz_j = g·(δ_jy − p_j) − h·p_j·(log p_j + H) and c_j the softcap factor (1 − tanh²), the input gradient
    Σ_j scale·c_j·dz_j·W_j = scale·[coef_y·W_y − (g + h·H)·A − h·B], where A = Σ_{j≠y} c_j·p_j·W_j and
    B = Σ_{j≠y} c_j·p_j·log p_j·W_j (`acc_p`, `acc_plogp`, fp32 [N, H]) and the target's own term
    coef_y = c_y·[g·(1 − p_y) − h·p_y·(log p_y + H)] comes from the fp32 statistics. The target is left out of A and
    B so that 1 − p_y is never formed as a difference of rounded vectors (p_y → 1 for confident tokens).

    `weight_rows(r0, r1)` returns W_y of rows r0:r1 as the projection saw them (compute dtype; promoted to fp32 inside
    the accumulation); g / h are fp32 [N] or None; `out` [N, H] receives the result (any float dtype), written in
    chunks of 2^22 elements (16 MiB fp32) so that the temporaries stay small next to A, B and `out`.
    """
    n = acc_p.shape[0]
    coef_y, coef_a, coef_b = frozen_coefficients(g, h, logprobs, entropy, c_target, scale)
    step = max(1, 2**22 // max(acc_p.shape[1], 1))
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        tmp = acc_p[r0:r1] * coef_a[r0:r1, None]
        if acc_plogp is not None:
            tmp.addcmul_(acc_plogp[r0:r1], coef_b[r0:r1, None])
        tmp.addcmul_(weight_rows(r0, r1), coef_y[r0:r1, None])
        out[r0:r1] = tmp
    return out
