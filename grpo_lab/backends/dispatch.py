"""The `grpo_lab` backend: the Triton kernel where it can run (CUDA with Triton), the chunked torch path elsewhere."""

from __future__ import annotations

from grpo_lab.kernels import TRITON_AVAILABLE, fused_linear_logprobs

from .chunked import chunked_logprobs


def grpo_lab_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None, logit_scale=1.0,
                      outputs=("log_probs",)):
    # `fused_linear_logprobs` always imports but raises without Triton, so Triton is checked here, not by the import.
    if hidden.device.type == "cuda" and TRITON_AVAILABLE:
        return fused_linear_logprobs(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale,
                                     outputs)
    return chunked_logprobs(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
