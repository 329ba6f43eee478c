"""The Triton kernel of the fused linear → log-prob head, `grpo_lab.loss.kernel`.

Never a top-level `kernels` package: that name is Hugging Face's `kernels`, which transformers imports. The modules
are listed in docs/architecture.md. Importing this package never needs Triton or a GPU: `fused_linear_logprobs`
imports the Triton implementation on first call.
"""

from __future__ import annotations

import importlib.util

from .policy import PathCounts, path_counts, reset_path_counts

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

__all__ = ["TRITON_AVAILABLE", "PathCounts", "fused_kernel_available", "fused_linear_logprobs", "path_counts",
           "reset_path_counts"]


def fused_kernel_available() -> bool:
    """True when the Triton kernel can run here: Triton importable and a CUDA device present."""
    if not TRITON_AVAILABLE:
        return False
    import torch

    return torch.cuda.is_available()


def fused_linear_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None,
                          logit_scale=1.0, outputs=("log_probs",)):
    """TRL `ChunkedLogProbFunction.apply` signature: `function.fused_linear_logprobs`, imported on first call."""
    if not TRITON_AVAILABLE:
        raise ImportError("grpo_lab.loss.kernel.fused_linear_logprobs needs Triton; use the grpo_lab backend, which "
                          "falls back to the chunked torch path.")
    from .function import fused_linear_logprobs as impl

    return impl(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
