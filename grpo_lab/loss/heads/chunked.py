"""grpo-lab's chunked linear -> log-prob in torch: the path used where the Triton kernel cannot run (CPU).

Tokens and vocabulary are cut into tiles; each `[token_tile, vocab_tile]` block of logits is formed in fp32, folded
into an online log-sum-exp (max, sum of exps, sum of exp·z for the entropy) and dropped, so no more than one tile
of logits exists at a time. The backward recomputes each tile and turns it into the logits gradient
`dL/dz_j = g·(δ_jy − p_j) − h·p_j·(log p_j + H)` (g, h: upstream grads of log-prob and entropy), then through the
temperature, softcap and logit scale, accumulating dX, dW and db in fp32. Rows whose target is negative (TRL's
`-100`) are skipped, not computed, and get log-prob 0.

A frozen head takes the two-GEMM path (`frozen`), as the Triton kernel does: A and B are accumulated in the forward
with the online-softmax rescaling, and the backward is elementwise.
"""

from __future__ import annotations

import torch

from ..contract import (OPTIONAL_OUTPUTS, check_logprob_inputs, compute_dtype_of, head_mode, outputs_from_stats,
                        scatter_grad, scatter_rows, select_rows, valid_rows)
from ..frozen import entropy_grad_expected, frozen_input_grad, note_entropy_grad

TOKEN_TILE = 1024
VOCAB_TILE = 8192


def _tile_logits(h32, w, b, start, end, logit_scale, softcap, inv_t, dtype):
    """fp32 logits of one tile, plus the tanh of the softcap (needed by the backward). The weight is rounded to the
    hidden states' dtype first, as a projection in that dtype would, then multiplied in fp32."""
    y = h32 @ w[start:end].to(dtype).float().t()
    if b is not None:
        y = y + b[start:end].to(dtype).float()
    y = y * logit_scale
    t = None
    if softcap is not None:
        t = torch.tanh(y / softcap)
        y = softcap * t
    return y * inv_t, t


class ChunkedLogProbFunction(torch.autograd.Function):
    """Same calling convention and outputs as TRL's `ChunkedLogProbFunction` (see `contract`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs,
                mode="trainable"):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        vocab_tile = chunk_size or VOCAB_TILE
        inv_t = 1.0 / temperature
        rows = valid_rows(targets)
        h, y = select_rows(rows, hidden, targets)
        m_rows = h.shape[0]
        dev = hidden.device
        sum_exp, z_sum_exp, sq_sum_exp, z_sum, target_logit = torch.zeros(5, m_rows, device=dev)
        running_max, max_before_target = torch.full((2, m_rows), float("-inf"), device=dev)
        want = {name: name in outputs for name in OPTIONAL_OUTPUTS}
        frozen = mode == "frozen"
        acc_p = torch.zeros(h.shape, device=dev) if frozen else None
        acc_plogp = torch.zeros(h.shape, device=dev) if frozen and want["entropy"] and entropy_grad_expected() else None
        with torch.no_grad():
            for t0 in range(0, m_rows, TOKEN_TILE):
                t1 = min(t0 + TOKEN_TILE, m_rows)
                h32 = h[t0:t1].float()
                yt = y[t0:t1]
                for v0 in range(0, vocab, vocab_tile):
                    v1 = min(v0 + vocab_tile, vocab)
                    z, tanh = _tile_logits(h32, weight, bias, v0, v1, logit_scale, softcap, inv_t, hidden.dtype)
                    local = yt - v0
                    if want["mean_logits"]:
                        z_sum[t0:t1] += z.sum(-1)
                    if want["is_top1"]:
                        before = torch.arange(v1 - v0, device=dev) < local.unsqueeze(-1)
                        max_before_target[t0:t1] = torch.maximum(
                            max_before_target[t0:t1], z.masked_fill(~before, float("-inf")).amax(-1))
                    new_max = torch.maximum(running_max[t0:t1], z.amax(-1))
                    rescale = torch.exp(running_max[t0:t1] - new_max)
                    e = torch.exp(z - new_max.unsqueeze(-1))
                    sum_exp[t0:t1] = sum_exp[t0:t1] * rescale + e.sum(-1)
                    if want["entropy"]:
                        z_sum_exp[t0:t1] = z_sum_exp[t0:t1] * rescale + (e * z).sum(-1)
                    if want["log_sum_sq_probs"]:
                        sq_sum_exp[t0:t1] = sq_sum_exp[t0:t1] * rescale * rescale + (e * e).sum(-1)
                    inside = (local >= 0) & (local < v1 - v0)
                    if frozen:
                        _accumulate_frozen(acc_p, acc_plogp, t0, t1, z, tanh, e, new_max, running_max[t0:t1],
                                           rescale, local, inside, weight[v0:v1].to(hidden.dtype).float())
                    running_max[t0:t1] = new_max
                    picked = z.gather(-1, local.clamp(0, v1 - v0 - 1).unsqueeze(-1)).squeeze(-1)
                    target_logit[t0:t1] = torch.where(inside, picked, target_logit[t0:t1])
        log_z, logprobs, entropy, extras = outputs_from_stats(running_max, sum_exp, z_sum_exp, sq_sum_exp, z_sum,
                                                              max_before_target, target_logit, vocab, want)

        if frozen:  # relative to the running max -> relative to log Z: A = f·A_rel, B = f·(B_rel − log(Σ)·A_rel)
            f = torch.exp(running_max - log_z).unsqueeze(-1)
            if acc_plogp is not None:
                acc_plogp.addcmul_(acc_p, -torch.log(sum_exp).unsqueeze(-1)).mul_(f)
            acc_p.mul_(f)
            ctx.frozen = (acc_p, acc_plogp, logprobs.clone(), target_logit)
        else:
            ctx.frozen = None
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy if entropy is not None else log_z, rows)
        ctx.conf = (vocab_tile, softcap, logit_scale, inv_t)
        ctx.has_entropy = entropy is not None
        ctx.mark_non_differentiable(*(x for x in extras if x is not None))
        return scatter_rows(rows, n, logprobs, entropy, *extras)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, bias, targets, log_z, entropy, rows = ctx.saved_tensors
        vocab_tile, softcap, logit_scale, inv_t = ctx.conf
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        h, y, g, ge = select_rows(rows, hidden, targets, grad_logprobs, grad_entropy)
        g = None if g is None else g.float()
        ge = None if ge is None else ge.float()
        if ctx.frozen is not None:
            note_entropy_grad(ge is not None)
            acc_p, acc_plogp, logprobs, target_logit = ctx.frozen
            if need_h and (ge is None or acc_plogp is not None):
                grad_h = _frozen_grad(h, weight, y, g, ge, acc_p, acc_plogp, logprobs,
                                      entropy if ctx.has_entropy else None, target_logit, softcap, logit_scale, inv_t)
                return (scatter_grad(grad_h, hidden, rows), None, None, None, None, None, None, None, None, None)
            # an entropy gradient the forward did not prepare for: the recomputing backward below, dX only
        m_rows, vocab = h.shape[0], weight.shape[0]
        dev = hidden.device
        grad_h = torch.zeros(h.shape, device=dev) if need_h else None
        grad_w = torch.zeros(weight.shape, device=dev) if need_w else None
        grad_b = torch.zeros(vocab, device=dev) if (need_b and bias is not None) else None
        if g is not None or ge is not None:
            for t0 in range(0, m_rows, TOKEN_TILE):
                t1 = min(t0 + TOKEN_TILE, m_rows)
                h32 = h[t0:t1].float()
                for v0 in range(0, vocab, vocab_tile):
                    v1 = min(v0 + vocab_tile, vocab)
                    z, tanh = _tile_logits(h32, weight, bias, v0, v1, logit_scale, softcap, inv_t, hidden.dtype)
                    log_p = z - log_z[t0:t1].unsqueeze(-1)
                    p = torch.exp(log_p)
                    dz = torch.zeros_like(z)
                    if g is not None:
                        gt = g[t0:t1].unsqueeze(-1)
                        dz -= gt * p
                        local = y[t0:t1] - v0
                        inside = (local >= 0) & (local < v1 - v0)
                        dz.scatter_add_(-1, local.clamp(0, v1 - v0 - 1).unsqueeze(-1),
                                        (g[t0:t1] * inside).unsqueeze(-1))
                    if ge is not None:
                        dz -= ge[t0:t1].unsqueeze(-1) * p * (log_p + entropy[t0:t1].unsqueeze(-1))
                    dz = dz * inv_t
                    if tanh is not None:
                        dz = dz * (1 - tanh * tanh)
                    dz = dz * logit_scale
                    if grad_h is not None:
                        grad_h[t0:t1] += dz @ weight[v0:v1].float()
                    if grad_w is not None:
                        grad_w[v0:v1] += dz.t() @ h32
                    if grad_b is not None:
                        grad_b[v0:v1] += dz.sum(0)
        return (
            None if grad_h is None else scatter_grad(grad_h, hidden, rows),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None, None, None, None, None,
        )


def _accumulate_frozen(acc_p, acc_plogp, t0, t1, z, tanh, e, new_max, old_max, rescale, local, inside, w32):
    """Fold one logits tile into A_rel = Σ c_j·e^(z_j − m)·W_j and B_rel = Σ c_j·e^(z_j − m)·(z_j − m)·W_j over
    j ≠ target, m the running max (both rescaled when m grows: B also shifts by (m_old − m_new)·A)."""
    pw = e if tanh is None else e * (1 - tanh * tanh)
    pw = pw.scatter(-1, local.clamp(0, pw.shape[1] - 1).unsqueeze(-1),
                    torch.where(inside, 0.0, pw.gather(-1, local.clamp(0, pw.shape[1] - 1).unsqueeze(-1)).squeeze(-1))
                    .unsqueeze(-1))
    if acc_plogp is not None:
        shift = torch.where(torch.isfinite(old_max), old_max - new_max, torch.zeros_like(new_max))
        acc_plogp[t0:t1] = ((acc_plogp[t0:t1] + shift.unsqueeze(-1) * acc_p[t0:t1]) * rescale.unsqueeze(-1)
                            + (pw * (z - new_max.unsqueeze(-1))) @ w32)
    acc_p[t0:t1] = acc_p[t0:t1] * rescale.unsqueeze(-1) + pw @ w32


def _frozen_grad(h, weight, y, g, ge, acc_p, acc_plogp, logprobs, entropy, target_logit, softcap, logit_scale, inv_t):
    """The frozen head's dX (fp32, valid rows) from the forward's A and B."""
    c_target = torch.ones_like(logprobs)
    if softcap is not None:
        t_y = target_logit / (softcap * inv_t)
        c_target = 1 - t_y * t_y
    out = torch.empty(h.shape, device=h.device)
    return frozen_input_grad(acc_p, acc_plogp, lambda r0, r1: weight[y[r0:r1]].to(h.dtype), g, ge,
                             logprobs, entropy, c_target, inv_t * logit_scale, out)


def chunked_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None, logit_scale=1.0,
                     outputs=("log_probs",)):
    """The chunked torch path; under autocast the projection inputs are cast to the autocast dtype first, so the
    numbers are those of a bf16 projection accumulated in fp32."""
    check_logprob_inputs(hidden, weight, bias, targets, temperature, outputs)
    dtype = compute_dtype_of(hidden)
    if dtype != hidden.dtype:
        hidden = hidden.to(dtype)
    mode = head_mode(hidden, weight, bias)
    with torch.autocast(hidden.device.type, enabled=False):
        return ChunkedLogProbFunction.apply(hidden, weight, bias, targets.long(), float(temperature), chunk_size,
                                            softcap, float(logit_scale), tuple(outputs), mode)
