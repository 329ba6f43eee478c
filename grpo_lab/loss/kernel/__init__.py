"""The Triton kernel of the fused linear → log-prob head, `grpo_lab.loss.kernel`.

Never a top-level `kernels` package: that name is Hugging Face's `kernels`, which transformers imports. Modules:
`tuning` (the `KernelTuning` dataclass and the `GRPO_LAB_*` environment, read once), `triton_kernels` (the
`@triton.jit` code), `policy` (the trainable head's memory policy and the counts of the paths taken: `path_counts()`),
`launch` (path choice, buffers and launches) and `function` (the autograd Function and `fused_linear_logprobs`).

Importing this package never needs Triton or a GPU: `fused_linear_logprobs` here is a thin function that imports the
Triton implementation on first call and raises a clear error where Triton is missing, and the `grpo_lab` head
(`heads.grpo_lab`) checks `TRITON_AVAILABLE` first and keeps the chunked torch path there.
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
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch always imports in this package
        return False


def fused_linear_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None,
                          logit_scale=1.0, outputs=("log_probs",)):
    """TRL `ChunkedLogProbFunction.apply` signature; the Triton implementation (`function.fused_linear_logprobs`) is
    imported on first call, so importing `grpo_lab.loss.kernel` never needs Triton or a GPU."""
    if not TRITON_AVAILABLE:
        raise ImportError("grpo_lab.loss.kernel.fused_linear_logprobs needs Triton; use the grpo_lab backend, which "
                          "falls back to the chunked torch path.")
    from .function import fused_linear_logprobs as impl

    return impl(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
