"""The `grpo_lab` backend: the Triton kernel where it can run (CUDA with Triton), the chunked torch path elsewhere."""

from __future__ import annotations

from .chunked import chunked_logprobs


def _triton_impl():
    try:
        from grpo_lab.kernels import fused_linear_logprobs
    except ImportError:
        return None
    return fused_linear_logprobs


def grpo_lab_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None, logit_scale=1.0,
                      outputs=("log_probs",)):
    if hidden.device.type == "cuda":
        impl = _triton_impl()
        if impl is not None:
            return impl(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
    return chunked_logprobs(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
