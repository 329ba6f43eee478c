"""The fp32 head's dX and dW as split-TF32 tensor-core GEMMs (`fp32_mm = "triton"`, `fp32_dot = "tf32x3"`).

Three TF32 products give fp32-level error at tensor-core speed, but Hopper's tensor cores take TF32 operands K-major
only, and the backward's two GEMMs contract dZ over different axes: dX = dZ·W over the vocabulary, dW = dZᵀ·X over
the tokens. So each gets its operands copied K-major, slice by slice of the vocabulary chunk: W[slice]ᵀ for dX,
dZ[:, slice]ᵀ and X[tile]ᵀ for dW. An fp32 GEMM of this head takes 100+ ms; the copies move a few hundred MB, a few
ms, and bounded buffers (`fp32_mm_slice` columns) keep the path's memory flat in N and V.
"""

from __future__ import annotations

import torch

import triton

from .descriptors import tma_target
from .triton_kernels import mm_kernel, nt_mm_kernel
from .tuning import TUNING

_ALIGN = 4  # fp32 elements per 16 bytes: a tensor descriptor's row stride must be a multiple


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def nt_mm(c: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, accumulate: bool) -> None:
    """c (+)= a @ btᵀ in fp32 with `fp32_dot` products; a [M, K] and bt [N, K] K-major, c [M, N] row-major."""
    m, k = a.shape
    n = bt.shape[0]
    bm, bn, bk, group_m, warps, stages = TUNING.configs["mm_32"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    (a_desc, a_tma), (b_desc, b_tma) = tma_target(a, bm, bk, TUNING.use_tma), tma_target(bt, bn, bk, TUNING.use_tma)
    if a_tma and b_tma and c.stride(1) == 1:
        nt_mm_kernel[grid](a_desc, b_desc, c, m, n, k, c.stride(0), ACC=accumulate, PRECISION=TUNING.fp32_dot,
                           BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)
        return
    mm_kernel[grid](a, bt, c, m, n, k, a.stride(0), a.stride(1), bt.stride(1), bt.stride(0), c.stride(0), c.stride(1),
                    ACC=accumulate, PRECISION=TUNING.fp32_dot, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps,
                    num_stages=stages)


class SplitTF32Gradients:
    """K-major operand buffers of one backward, and the GEMMs that add a dZ tile's share to dX and dW.

    `rows(h_tile)` sets the token tile whose dZ follows (its Xᵀ, for dW); `add(tile, weight_chunk, grad_h_rows,
    grad_w_chunk)` then accumulates `tile @ weight_chunk` into the fp32 `grad_h_rows` and `tileᵀ @ X` into the fp32
    `grad_w_chunk` (either may be None), `fp32_mm_slice` vocabulary columns at a time."""

    def __init__(self, hidden_size: int, t_tile: int, v_tile: int, device, need_h: bool, need_w: bool):
        self.slice = min(TUNING.fp32_mm_slice, v_tile)
        empty = lambda *shape: torch.empty(shape, device=device, dtype=torch.float32)  # noqa: E731
        self.wt = empty(hidden_size, _padded(self.slice)) if need_h else None  # W[slice]ᵀ
        self.dzt = empty(self.slice, _padded(t_tile)) if need_w else None  # dZ[:, slice]ᵀ
        self.xt = empty(hidden_size, _padded(t_tile)) if need_w else None  # X[tile]ᵀ
        self.n_rows = 0

    def rows(self, h_tile: torch.Tensor) -> None:
        self.n_rows = h_tile.shape[0]
        if self.xt is not None:
            self.xt[:, : self.n_rows].copy_(h_tile.t())

    def add(self, tile, weight_chunk, grad_h_rows, grad_w_chunk) -> None:
        n = self.n_rows
        for s0 in range(0, tile.shape[1], self.slice):
            s1 = min(tile.shape[1], s0 + self.slice)
            dz = tile[:, s0:s1]
            if grad_h_rows is not None:
                wt = self.wt[:, : s1 - s0]
                wt.copy_(weight_chunk[s0:s1].t())
                nt_mm(grad_h_rows, dz, wt, accumulate=True)
            if grad_w_chunk is not None:
                dzt = self.dzt[: s1 - s0, :n]
                dzt.copy_(dz.t())
                nt_mm(grad_w_chunk[s0:s1], dzt, self.xt[:, :n], accumulate=True)
