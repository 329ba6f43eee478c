"""The frozen head's gradient algebra, shared by the torch and Triton paths.

A frozen head (`contract.head_mode`: PEFT / LoRA) owes only the hidden states a gradient, so its forward accumulates
A = Σ_{j≠y} c_j·p_j·W_j (and B = Σ_{j≠y} c_j·p_j·log p_j·W_j when an entropy gradient is coming) while the logits
are there, and its backward is elementwise: no recomputed logits, no weight-gradient GEMM.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

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
