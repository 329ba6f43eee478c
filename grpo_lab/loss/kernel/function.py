"""`fused_linear_logprobs`: per-token log-probs (and entropies) of a linear head on CUDA, never holding its logits.

A thin autograd Function: it drops the rows whose target is negative (log-prob 0, zero gradients, not computed), runs
the forward of the path `launch.choose_path` picks, turns its statistics into the outputs and routes the backward.
"""

from __future__ import annotations

import torch

from ..contract import (OPTIONAL_OUTPUTS, check_logprob_inputs, compute_dtype_of, head_mode, outputs_from_stats,
                        scatter_rows, select_rows, valid_rows)
from ..frozen import entropy_grad_expected, note_entropy_grad
from .launch import (TL_DTYPE, choose_path, dtype_key, frozen_backward, frozen_forward, materialized_backward,
                     materialized_backward_reads_only, materialized_forward, recompute_backward, statistics_forward)
from .tuning import TUNING


class FusedLinearLogProbFunction(torch.autograd.Function):
    """TRL `ChunkedLogProbFunction` calling convention (`contract`), CUDA + Triton. Three ways to the gradient:
    `frozen` (`frozen.py`), `materialized` (the forward keeps the [N, V] probabilities: two cuBLAS GEMMs back) and
    `recompute` (the logits recomputed tile by tile, memory flat in N), as the memory policy allows (`policy.py`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, compute,
                mode):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        inv_t = 1.0 / temperature
        want = {name: name in outputs for name in OPTIONAL_OUTPUTS}
        rows = valid_rows(targets)
        n_valid = n if rows is None else rows.numel()
        h, y = (t.contiguous() for t in select_rows(rows, hidden, targets))
        dev = hidden.device
        path = choose_path(mode, compute, softcap, n_valid, vocab, dev, hidden.shape[1],
                           weight.numel() * weight.element_size())
        ctx.path, ctx.extra, ctx.mode = path, None, mode
        if n_valid > 0:
            if path == "frozen":
                with_plogp = want["entropy"] and entropy_grad_expected()
                stats, acc, pending = frozen_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute,
                                                     want, with_plogp)
            elif path == "materialized":
                stats, full, shift, pending = materialized_forward(h, weight, bias, y, inv_t, softcap, logit_scale,
                                                                   compute, want)
            else:
                stats = statistics_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
            log_z, logprobs, entropy, extras = outputs_from_stats(*stats, vocab, want)
            if path == "frozen":
                # the target logit (softcap factor of the target); the rows check the backward resolves, if any
                ctx.extra = (acc, logprobs.clone(), stats[-1], pending)
            elif path == "materialized":
                ctx.extra = (full, logprobs.clone(), shift, pending)
        else:  # no valid row: empty outputs of the right kinds
            log_z, logprobs, entropy, extras = outputs_from_stats(*torch.zeros(7, 0, device=dev), vocab, want)
        ctx.save_for_backward(hidden, weight, bias, y, log_z, entropy if entropy is not None else log_z, rows)
        ctx.conf = (softcap, logit_scale, inv_t, compute, n_valid, entropy is not None)
        outs = scatter_rows(rows, n, logprobs, entropy, *extras)
        ctx.mark_non_differentiable(*(x for x in outs[2:] if x is not None))
        return outs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, bias, y, log_z, entropy, rows = ctx.saved_tensors
        softcap, logit_scale, inv_t, compute, n_valid, has_entropy = ctx.conf
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g, ge = select_rows(rows, grad_logprobs, grad_entropy)
        g = None if g is None else g.float().contiguous()
        ge = None if ge is None else ge.float().contiguous()
        grads = None

        def resolve(pending) -> int:  # the forward's rows check; the valid rows' inputs only if rows need redoing
            if pending is None:
                return 0
            return pending.resolve(lambda: hidden.contiguous() if rows is None else hidden.index_select(0, rows))

        def checked(backward, pending, reads_only: bool):
            """The backward's gradients with the forward's rows check resolved. A backward that only reads what the
            check repairs is queued first: the host then waits on the check while the GPU already has the
            backward's work, instead of leaving the GPU idle while it queues it; in the rare case rows were
            repaired it runs again on the repaired values."""
            if not reads_only:
                resolve(pending)
                return backward()
            grads = backward()
            return backward() if resolve(pending) else grads

        if ctx.path == "frozen":
            note_entropy_grad(ge is not None)
            acc, logprobs, tlogit, pending = ctx.extra
            if ge is None or acc.shape[0] == 2:  # else: an entropy gradient the forward did not prepare for
                grads = checked(lambda: (frozen_backward(
                    hidden, weight, y, g, ge, acc, logprobs, entropy if has_entropy else None, tlogit, softcap,
                    logit_scale, inv_t, compute, rows), None, None), pending, reads_only=True)
        elif ctx.path == "materialized" and n_valid > 0 and (g is not None or ge is not None):
            full, logprobs, shift, pending = ctx.extra
            grads = checked(lambda: materialized_backward(
                (full, logprobs, shift), hidden, weight, bias, y, g, ge, entropy, logit_scale * inv_t, compute,
                rows, need_h, need_w, need_b), pending, reads_only=materialized_backward_reads_only(ge))
        if grads is None:
            tile = (TUNING.frozen_tile if ctx.mode == "frozen" else TUNING.bwd_tile)[dtype_key(compute)]
            grads = recompute_backward(hidden, weight, bias, y, log_z, entropy, g, ge, rows, softcap, logit_scale,
                                       inv_t, compute, n_valid, need_h, need_w, need_b, tile)
        ctx.extra = None
        grad_h, grad_w, grad_b = grads
        return (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None, None, None, None)


def fused_linear_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None,
                          logit_scale=1.0, outputs=("log_probs",)):
    """Per-token log-probs of `hidden @ weight.T (+ bias)` and the requested extras, never holding the logits.

    TRL's `ChunkedLogProbFunction.apply` arguments (`chunk_size` ignored: the tiles are this kernel's own). Under
    autocast the projection runs in the autocast dtype, cast inside the kernel; accumulation is always fp32."""
    check_logprob_inputs(hidden, weight, bias, targets, temperature, outputs)
    if hidden.device.type != "cuda":
        raise ValueError("fused_linear_logprobs needs CUDA tensors; use grpo_lab.loss.heads.chunked elsewhere.")
    compute = compute_dtype_of(hidden)
    if compute not in TL_DTYPE:
        raise TypeError(f"unsupported compute dtype {compute}")
    mode = head_mode(hidden, weight, bias)
    weight_c = weight if weight.stride(-1) == 1 else weight.contiguous()
    hidden_c = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()  # the kernels index it densely
    with torch.autocast("cuda", enabled=False):
        return FusedLinearLogProbFunction.apply(hidden_c, weight_c, bias, targets.long(), float(temperature),
                                                chunk_size, softcap, float(logit_scale), tuple(outputs), compute, mode)
