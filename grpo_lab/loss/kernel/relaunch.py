"""Launching one Triton kernel over a loop of vocabulary chunks without Triton's per-launch dispatch.

`kernel[grid](...)` binds and re-specialises every argument (some 40 for the fused forward) on each call before it
reaches the compiled kernel's launcher. Across the chunks of one token tile almost nothing changes: the vocabulary
bounds, the grid, the last chunk's width. A head small enough to be bound by the host (a frozen head at ≤ 8k tokens)
spends its time there (`benchmarks/step_timeline.py --host-profile`), so a `Relauncher` launches the first chunk of
each specialisation through Triton's JIT and later ones straight through the kernel it compiled.

The caller names what may change between its launches in `key` (a function of no arguments, called only when
`direct_launch` is on, so the default path pays nothing for it): every argument whose Triton specialisation (an int's
value 1, its divisibility by 16 and width, a pointer's 16-byte alignment and dtype, a descriptor's block and dtype) can
differ must be in it, through `int_spec` / `arg_spec`; arguments left out must be the same objects each time or keep
their specialisation by construction.
"""

from __future__ import annotations

import torch

from .tuning import TUNING


def int_spec(value: int) -> tuple:
    """What Triton specialises an integer argument on: equal to 1, divisible by 16, 32-bit."""
    return value == 1, value % 16 == 0, -(2**31) <= value < 2**31


def arg_spec(value) -> tuple:
    """What Triton specialises a tensor or tensor-descriptor argument on (more, for a descriptor: its shape and
    strides too, so two descriptors of one key are interchangeable by any reading of the specialisation rules)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    base = value.base
    return (base.dtype, base.data_ptr() % 16 == 0, tuple(value.block_shape), tuple(value.shape),
            tuple(value.strides), getattr(value, "padding", None))


class Relauncher:
    """One kernel's launches in one loop: Triton's JIT for the first launch of each `key`, then the compiled kernel.

    Under Triton's interpreter (which compiles nothing) or with `direct_launch` off, every launch goes through the
    JIT."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}

    def __call__(self, grid: tuple, key, args: dict, options: dict):
        """Launches `kernel[grid](**args, **options)`; `args` names every kernel argument, constexprs included, and
        `key()` gives the launch's specialisation key."""
        if not TUNING.direct_launch:
            return self.kernel[grid](**args, **options)
        key = key()
        compiled = self.compiled.get(key)
        if compiled is not None:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*[args[name] for name in self.kernel.arg_names])
            return compiled
        compiled = self.kernel[grid](**args, **options)
        if callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "function"):
            self.compiled[key] = compiled
        return compiled
