"""The fused head's row-wise kernels (and the fp32 path's split-TF32 GEMM) compile for sm_90a on a CPU, in every
variant the launch code asks for.

Triton's interpreter runs a kernel as Python, so it accepts code the compiler refuses: issue 45's merge_kernel passed
every interpreter case and failed all 63 GPU tests that reach it (a name reused for values of two types across its
loop). Compiling needs no GPU (Triton ships ptxas): `benchmarks/kernel_sass.py` does it, as it does for the big fused
kernels in test_kernel_sass_cpu.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmark_scripts import load_benchmark  # noqa: E402

from grpo_lab.loss.kernel import triton_kernels as tk  # noqa: E402

ROW_CONFIG = (64, 128, 0, 0, 4, 3)  # (BM, BN, BK, GROUP_M, warps, stages): BM / BN for dz_from_p_kernel's blocks


@pytest.fixture(scope="module")
def sass():
    return load_benchmark("kernel_sass")


_STATS = dict(HAS_ENTROPY=True, HAS_SQ=True, HAS_MEAN=True, HAS_TOP1=True, BR=128, BV=32)


@pytest.mark.parametrize("zero_p", [0, 1, 2])
@pytest.mark.parametrize("ref_stats", [False, True])
def test_merge_kernel_compiles_with_and_without_the_target_zeroing(sass, zero_p, ref_stats):
    compiled = sass.compile_kernel(tk.merge_kernel, dict(_STATS, REF_STATS=ref_stats, ZERO_P=zero_p), {}, ROW_CONFIG)
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("kernel, constexprs", [
    (tk.frozen_finish_kernel, dict(HAS_B=True, BR=16, BH=256)),
    (tk.frozen_dx_kernel, dict(HAS_G=True, HAS_GE=True, HAS_B=True, HAS_SOFTCAP=True, BR=16, BH=256)),
    (tk.ref_logit_kernel, dict(HAS_BIAS=True, HAS_SOFTCAP=True, BR=16, BH=256)),
    (tk.dz_from_p_kernel, dict(HAS_G=True, HAS_GE=True)),
], ids=["frozen_finish", "frozen_dx", "ref_logit", "dz_from_p"])
def test_row_kernels_compile(sass, kernel, constexprs):
    assert sass.compile_kernel(kernel, constexprs, {}, ROW_CONFIG).asm["cubin"]


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_split_tf32_gemm_compiles_on_k_major_descriptors(sass, accumulate):
    from grpo_lab.loss.kernel.tuning import TUNING

    bm, bn, bk = TUNING.configs["mm_32"][:3]
    blocks = {"a_desc": f"fp32[{bm},{bk}]", "b_desc": f"fp32[{bn},{bk}]"}
    compiled = sass.compile_kernel(tk.nt_mm_kernel, dict(ACC=accumulate, PRECISION=TUNING.fp32_dot), blocks,
                                   TUNING.configs["mm_32"])
    assert compiled.asm["cubin"]
    # TF32 tensor-core products (Hopper's wgmma takes them from K-major operands only), fed by TMA loads
    assert "wgmma.mma_async" in compiled.asm["ptx"] and ".tf32.tf32" in compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]
