"""The `grpo_lab` head: the Triton kernel where it can run (CUDA with Triton), the chunked torch path elsewhere."""

from __future__ import annotations

import torch

from ..contract import compute_dtype_of
from ..kernel import TRITON_AVAILABLE, fused_linear_logprobs
from .chunked import chunked_logprobs

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton kernel computes in


def grpo_lab_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None, logit_scale=1.0,
                      outputs=("log_probs",)):
    # `fused_linear_logprobs` always imports but raises without Triton, so Triton is checked here, not by the import;
    # float64 (a gradcheck, a reference run) has no Triton path and takes the torch one.
    if hidden.device.type == "cuda" and TRITON_AVAILABLE and compute_dtype_of(hidden) in KERNEL_DTYPES:
        return fused_linear_logprobs(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale,
                                     outputs)
    return chunked_logprobs(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
