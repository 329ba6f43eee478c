"""The frozen LM head's first GEMM in CUTLASS (Hopper, warp-specialised), with its softmax epilogue fused.

`frozen_logits_exp` writes P~ = e^(s·X·Wᵀ − ref) in bf16 for one [token tile, vocabulary chunk] block and the
block's per-row partial sums Σ P~ (and Σ P~·(s·z − ref)), which is what the two-GEMM frozen path
(`fused_linear_logprob._frozen_forward`) needs before cuBLAS multiplies P~ by the weight. Built on first use
(`build.py`); `available()` says whether this machine can run it.
"""

from __future__ import annotations

import os

import torch

from .build import DEFAULT_VARIANT, VARIANTS, ToolchainMissing, load

__all__ = ["available", "frozen_logits_exp", "supports"]

VARIANT = os.environ.get("GRPO_LAB_CUTLASS_VARIANT", DEFAULT_VARIANT)
_BUFFERS: dict[torch.device, dict[str, torch.Tensor]] = {}  # workspace, partial sums


def _library(allow_build: bool = True):
    return load(VARIANTS[VARIANT], allow_build=allow_build)


def available(allow_build: bool = True) -> bool:
    """A Hopper GPU (sm_90) is here and the library is built or can be built now."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        _library(allow_build)
    except (ToolchainMissing, RuntimeError, OSError):
        return False
    return True


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """What the kernel's TMA descriptors need of the operands: bf16, unit inner strides, 16-byte aligned rows and
    bases, a vocabulary in whole 16-byte rows of P~ (the P~ buffer is the caller's, allocated to match)."""
    return x.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0 and all(
        t.dtype == torch.bfloat16 and t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
        for t in (x, weight))


def frozen_logits_exp(x: torch.Tensor, weight: torch.Tensor, neg_ref: torch.Tensor, p: torch.Tensor, scale: float,
                      with_ez: bool) -> torch.Tensor:
    """p[:rows, :cols] = e^(scale·x·weightᵀ − ref) in bf16; returns the per-row partial sums of p (and, `with_ez`, of
    p·(scale·z − ref)), fp32 [1 or 2, column blocks, rows rounded up to the CTA tile]: sum over dim 1, keep [:rows].
    x: [rows, H], weight: [cols, H], neg_ref = −ref: fp32 [rows]. The partials live in a buffer the next call reuses."""
    lib = _library()
    rows, hidden = x.shape
    cols = weight.shape[0]
    dev = x.device
    tm, tn = lib.grpo_frozen_tile_m(), lib.grpo_frozen_tile_n()
    blocks, padded = -(-cols // tn), -(-rows // tm) * tm
    depth = 2 if with_ez else 1
    size = lib.grpo_frozen_workspace_size(rows, cols, hidden)
    for key, numel, dtype in (("ws", size, torch.uint8), ("sums", 2 * blocks * padded, torch.float32)):
        if key not in _BUFFERS.setdefault(dev, {}) or _BUFFERS[dev][key].numel() < numel:
            _BUFFERS[dev][key] = torch.empty(max(numel, 1), dtype=dtype, device=dev)
    sums = _BUFFERS[dev]["sums"][: depth * blocks * padded].view(depth, blocks, padded)
    status = lib.grpo_frozen_forward(
        x.data_ptr(), weight.data_ptr(), neg_ref.data_ptr(), p.data_ptr(), sums[0].data_ptr(),
        sums[1].data_ptr() if with_ez else None, rows, cols, hidden, x.stride(0), weight.stride(0), p.stride(0),
        float(scale), _BUFFERS[dev]["ws"].data_ptr(), torch.cuda.current_stream(dev).cuda_stream)
    if status != 0:
        raise RuntimeError(f"CUTLASS frozen-head kernel failed (status {status}) on rows={rows} cols={cols} "
                           f"hidden={hidden}")
    return sums
