"""Host-side tensor descriptors (TMA) of the kernels' 2-D operands, where a tensor's layout allows them."""

from __future__ import annotations

import torch


def tma_target(tile: torch.Tensor, rows: int, cols: int, wanted: bool):
    """(arg, use_tma): a [rows, cols]-block tensor descriptor of the 2-D `tile` when wanted, its layout allows bulk
    copies (unit inner stride, 16-byte row stride and base) and Triton has host-side descriptors; else `tile`."""
    ok = (wanted and tile.stride(1) == 1 and (tile.stride(0) * tile.element_size()) % 16 == 0
          and tile.data_ptr() % 16 == 0)
    if not ok:
        return tile, False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host-side tensor descriptors: the pointer path
        return tile, False
    return TensorDescriptor.from_tensor(tile, [rows, cols]), True
