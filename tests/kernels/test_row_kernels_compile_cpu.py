"""The fused head's row-wise kernels compile for sm_90a on a CPU, in every variant the launch code asks for.

Triton's interpreter runs a kernel as Python, so it accepts code the compiler refuses: issue 45's merge_kernel passed
every interpreter case and failed all 63 GPU tests that reach it (a name reused for values of two types across its
loop). Compiling needs no GPU (Triton ships ptxas); the big fused kernels are compiled by test_kernel_sass_cpu.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from grpo_lab.loss.kernel import triton_kernels as tk  # noqa: E402

_POINTERS = {"p_ptr": "*bf16", "pz_ptr": "*bf16", "h_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
             "out_ptr": "*bf16", "tgt_ptr": "*i64", "y_ptr": "*i64", "bad_ptr": "*i8", "count_ptr": "*i32"}
_FLOATS = {"limit", "excess", "scale", "inv_cap", "logit_scale", "softcap", "inv_t"}


def _compile(kernel, constexprs: dict, num_warps: int = 4):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTERS.get(name, "*fp32")
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


_STATS = dict(HAS_ENTROPY=True, HAS_SQ=True, HAS_MEAN=True, HAS_TOP1=True, BR=128, BV=32)


@pytest.mark.parametrize("zero_p", [0, 1, 2])
@pytest.mark.parametrize("ref_stats", [False, True])
def test_merge_kernel_compiles_with_and_without_the_target_zeroing(zero_p, ref_stats):
    compiled = _compile(tk.merge_kernel, dict(_STATS, REF_STATS=ref_stats, ZERO_P=zero_p))
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("kernel, constexprs", [
    (tk.frozen_finish_kernel, dict(HAS_B=True, BR=16, BH=256)),
    (tk.frozen_dx_kernel, dict(HAS_G=True, HAS_GE=True, HAS_B=True, HAS_SOFTCAP=True, COMPUTE=tl.bfloat16, BR=16,
                               BH=256)),
    (tk.ref_logit_kernel, dict(HAS_BIAS=True, HAS_SOFTCAP=True, COMPUTE=tl.bfloat16, BR=16, BH=256)),
    (tk.dz_from_p_kernel, dict(HAS_G=True, HAS_GE=True, BM=64, BN=128)),
], ids=["frozen_finish", "frozen_dx", "ref_logit", "dz_from_p"])
def test_row_kernels_compile(kernel, constexprs):
    assert _compile(kernel, constexprs).asm["cubin"]
