"""The `naive` head, the pre-fused baseline: materialise the full [N, V] logits, upcast to fp32, log-softmax, gather.

What GRPO trainers did before chunked heads, the baseline of the "Liger GRPO meets TRL" blog post, and the ground
truth the fused heads are tested against (plain autograd, no hand-written gradient).
"""

from __future__ import annotations

import torch

from ..contract import check_logprob_inputs, compute_dtype_of, transform_logits


def naive_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None, logit_scale=1.0,
                   outputs=("log_probs",)):
    check_logprob_inputs(hidden, weight, bias, targets, temperature, outputs)
    dtype = compute_dtype_of(hidden)
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    z = transform_logits(logits.float(), logit_scale, softcap, temperature)
    log_p = torch.log_softmax(z, dim=-1)
    safe_targets = targets.clamp(min=0).long()
    logprobs = log_p.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
    with torch.no_grad():
        log_sum_sq = torch.logsumexp(2 * log_p, dim=-1) if "log_sum_sq_probs" in outputs else None
        mean_logits = z.mean(-1) if "mean_logits" in outputs else None
        is_top1 = (z.argmax(-1) == safe_targets) if "is_top1" in outputs else None
    return logprobs, entropy, log_sum_sq, mean_logits, is_top1
