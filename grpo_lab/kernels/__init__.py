"""Triton kernels of grpo-lab: `grpo_lab.kernels` (never a top-level `kernels` package, which is Hugging Face's).

`fused_linear_logprobs` always imports: on a machine without Triton (or without CUDA) it is a thin function that
raises a clear error when called with CUDA tensors it cannot serve, and `grpo_lab.backends.dispatch` checks
`TRITON_AVAILABLE` / `fused_kernel_available()` first and keeps the chunked torch path there.
"""

from __future__ import annotations

import importlib.util

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

__all__ = ["TRITON_AVAILABLE", "fused_kernel_available", "fused_linear_logprobs"]


def fused_kernel_available() -> bool:
    """True when the Triton kernel can run here: Triton importable and a CUDA device present."""
    if not TRITON_AVAILABLE:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch always imports in this package
        return False


def fused_linear_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None,
                          logit_scale=1.0, outputs=("log_probs",)):
    """TRL `ChunkedLogProbFunction.apply` signature; the Triton implementation lives in `fused_linear_logprob`
    and is imported on first call, so importing `grpo_lab.kernels` never needs Triton or a GPU."""
    if not TRITON_AVAILABLE:
        raise ImportError("grpo_lab.kernels.fused_linear_logprobs needs Triton; use the grpo_lab backend, which "
                          "falls back to the chunked torch path.")
    from .fused_linear_logprob import fused_linear_logprobs as impl

    return impl(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
