"""Fused linear -> per-token log-prob (+ entropy) on CUDA: Triton GEMM tiles with the softmax work in the epilogue.

Forward. One Triton matmul kernel computes `[BM tokens, BN vocab]` blocks of `hidden @ weight.T` in fp32 registers
(K = H loop, tensor cores for bf16/fp16, IEEE fp32 or split-TF32 ("tf32x3") for fp32) and, in the epilogue, applies
scale / softcap / temperature and reduces the block to per-row partial online-LSE statistics (max, sum of exps,
sum of exp·z for the entropy, ...). The logits never reach HBM: only `n_vblocks × N` partial stats do, for one
vocabulary chunk at a time (a fixed budget, so memory is flat in N); torch merges them into running stats.

Backward. The same GEMM recomputes the logits of a `[token tile, vocab chunk]` tile and its epilogue turns them
into the logits gradient `dL/dz_j = (1/T)·[g·(δ_jy − p_j) − h·p_j·(log p_j + H)]` (through softcap and scale),
written once in the compute dtype. cuBLAS then does `dX += dZ @ W` (fp32 accumulator) and `dW = dZᵀ @ X`. The loop
is vocabulary-outer so the weight gradient of a vocabulary chunk is finished before the next one starts: it goes
straight into the weight-dtype gradient (one GEMM when all tokens fit one tile, else a chunk-sized fp32 buffer), so
no full-size fp32 copy of the weight gradient ever exists (TRL keeps one).

Rows whose target is negative are dropped before any GEMM (not computed) and get log-prob 0 and zero gradients.
"""

from __future__ import annotations

import inspect
import os

import torch

import triton
import triton.language as tl

from grpo_lab.backends.base import OPTIONAL_OUTPUTS, check_logprob_inputs, compute_dtype_of

# Tile configuration per compute dtype: (BM, BN, BK, GROUP_M, num_warps, num_stages). Chosen on the H200 by
# benchmarks/loss_bench.py --tune (see docs/kernel.md); overridable for experiments.
CONFIGS = {
    "fwd_16": (128, 256, 64, 8, 8, 3),
    "bwd_16": (128, 256, 64, 8, 8, 3),
    "fwd_32": (128, 128, 32, 8, 8, 3),
    "bwd_32": (128, 128, 32, 8, 8, 3),
    "mm_32": (128, 128, 32, 8, 8, 3),
}
# Tensor-descriptor (TMA) loads in the fused kernels where the strides allow; fp32 path's dX/dW GEMMs in Triton
# ("triton", split-TF32 when FP32_DOT is tf32x3) or cuBLAS ("cublas", plain SGEMM with TF32 off).
# TMA on by default: 21.6 vs 24.0 ms for the bf16 B=64 forward on the H200 (tune_run2.csv).
USE_TMA = os.environ.get("GRPO_LAB_TMA", "1") == "1"
FP32_MM = os.environ.get("GRPO_LAB_FP32_MM", "cublas")
# Backward tile of the dZ buffer (tokens, vocabulary) per compute dtype; GRPO_LAB_BWD_TOKENS / _VOCAB override both.
# Measured on the H200 (results/loss_kernel/tune_run3.csv): 16-bit 16384 × 8192 (256 MiB bf16; K = 16384 for the
# cuBLAS dW GEMM, half the fp32 accumulator passes), 71.5 vs 71.7 ms at 8192 × 8192 with the persistent kernels
# (73.8 vs 75.2 without); fp32 keeps 8192 × 8192 (256 MiB), which holds its loss memory under 0.8× TRL's.
BWD_TILE = {
    key: (int(os.environ.get("GRPO_LAB_BWD_TOKENS", tokens)), int(os.environ.get("GRPO_LAB_BWD_VOCAB", 8192)))
    for key, tokens in (("16", 16384), ("32", 8192))
}
PART_BUDGET_BYTES = 32 * 2**20
# Persistent launch per fused kernel and dtype (keys as CONFIGS): one program per SM loops over the tiles, its loop
# flattened with the K loop so the next tile's loads are issued while this tile's softmax epilogue runs, instead of
# one program per tile.
# On by default for 16-bit: bf16 B=64 head fwd+bwd 71.7 vs 75.2 ms on the H200 (tune_run3.csv); fp32 gained nothing
# (662 vs 658 ms). GRPO_LAB_PERSISTENT, when set, lists the keys to turn on ("" for none). Needs a Triton whose
# `tl.range` has `flatten` (3.3+); older ones get the one-program-per-tile launch.
PERSISTENT = {key: False for key in CONFIGS if key != "mm_32"}
_PERSISTENT_ON = [k.strip() for k in os.environ.get("GRPO_LAB_PERSISTENT", "fwd_16,bwd_16").split(",") if k.strip()]
if set(_PERSISTENT_ON) - set(PERSISTENT):
    raise ValueError(f"GRPO_LAB_PERSISTENT={os.environ.get('GRPO_LAB_PERSISTENT')!r}: keys are {sorted(PERSISTENT)}")
PERSISTENT.update({key: True for key in _PERSISTENT_ON})
_FLATTEN_OK = "flatten" in inspect.signature(tl.range).parameters
# Programs of a persistent launch: None = one per SM (3 off CUDA, for Triton's interpreter), fewer when there are
# fewer tiles. The count is a compile-time constant: launches of under one program per SM compile their own variant
# (a bounded few: small token tiles and the last vocabulary chunk).
PERSISTENT_PROGRAMS = None
# The backward writes dZ through a tensor descriptor (bulk store, clipped at the tile's edges) when TMA loads are on;
# per compute dtype. Off: no gain on the H200 (tune_run3.csv). GRPO_LAB_DZ_TMA=1 turns it on for both.
DZ_TMA = {key: os.environ.get("GRPO_LAB_DZ_TMA", "0") == "1" for key in ("16", "32")}
# fp32 dot: "ieee" (plain fp32 FMA) or "tf32x3" (three TF32 products, fp32-level error, on tensor cores)
FP32_DOT = os.environ.get("GRPO_LAB_FP32_DOT", "tf32x3")

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _tile_logits(h_ptr, w_ptr, b_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h, stride_w,
                 logit_scale, softcap, inv_t,
                 HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    """fp32 logits z of block (pid_m, pid_n), the vocab offsets, the column / row validity and tanh (softcap)."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = v_lo + pid_n * BN + tl.arange(0, BN)
    row_ok = offs_m < M
    col_ok = offs_n < v_hi
    # Out-of-range rows/columns read a valid row instead (no masks in the K loop); their results are never kept.
    safe_m = tl.where(row_ok, offs_m, 0).to(tl.int64)
    safe_n = tl.where(col_ok, offs_n, v_lo).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if USE_TMA:
        # h_ptr / w_ptr are host-built tensor descriptors: the copy engine zero-fills rows past M or V and the K tail
        for k in range(0, tl.cdiv(K, BK)):
            a = h_ptr.load([pid_m * BM, k * BK])
            b = w_ptr.load([v_lo + pid_n * BN, k * BK])
            acc = tl.dot(a.to(COMPUTE), b.to(COMPUTE).T, acc, input_precision=PRECISION)
    else:
        rk = tl.arange(0, BK)
        a_ptrs = h_ptr + safe_m[:, None] * stride_h + rk[None, :]
        b_ptrs = w_ptr + safe_n[None, :] * stride_w + rk[:, None]
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = rk + k * BK < K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a.to(COMPUTE), b.to(COMPUTE), acc, input_precision=PRECISION)
            a_ptrs += BK
            b_ptrs += BK
    if HAS_BIAS:
        bias = tl.load(b_ptr + safe_n).to(COMPUTE).to(tl.float32)
        acc += bias[None, :]
    z = acc * logit_scale
    t = z
    if HAS_SOFTCAP:
        t = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0  # tanh(z / softcap)
        z = softcap * t
    z = z * inv_t
    return z, t, offs_m, offs_n, row_ok, col_ok


@triton.jit
def _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % size_m
    pid_n = (pid % group_size) // size_m
    return pid_m, pid_n


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr,
                M, v_lo, v_hi, K, stride_h, stride_w, part_stat_stride,
                logit_scale, softcap, inv_t,
                HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
                COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                PERSISTENT: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(v_hi - v_lo, BN)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
            _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h,
                      stride_w, part_stat_stride, logit_scale, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY,
                      HAS_SQ, HAS_MEAN, HAS_TOP1, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK)
    else:
        pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h,
                  stride_w, part_stat_stride, logit_scale, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY,
                  HAS_SQ, HAS_MEAN, HAS_TOP1, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK)


@triton.jit
def _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, pid_m, pid_n,
              M, v_lo, v_hi, K, stride_h, stride_w, part_stat_stride,
              logit_scale, softcap, inv_t,
              HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
              HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
              COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One [BM, BN] block: its logits, reduced to per-row partial statistics in `part`."""
    z, t, offs_m, offs_n, row_ok, col_ok = _tile_logits(
        h_ptr, w_ptr, b_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h, stride_w, logit_scale, softcap, inv_t,
        HAS_BIAS, HAS_SOFTCAP, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK)
    zm = tl.where(col_ok[None, :], z, -float("inf"))
    m = tl.max(zm, axis=1)
    e = tl.exp(zm - m[:, None])
    base = part_ptr + pid_n * M + offs_m
    tl.store(base, m, mask=row_ok)
    tl.store(base + part_stat_stride, tl.sum(e, axis=1), mask=row_ok)
    if HAS_ENTROPY:
        tl.store(base + 2 * part_stat_stride, tl.sum(e * tl.where(col_ok[None, :], z, 0.0), axis=1), mask=row_ok)
    if HAS_SQ:
        tl.store(base + 3 * part_stat_stride, tl.sum(e * e, axis=1), mask=row_ok)
    if HAS_MEAN:
        tl.store(base + 4 * part_stat_stride, tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1), mask=row_ok)
    tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1)
    if HAS_TOP1:
        before = offs_n[None, :] < tgt[:, None]
        tl.store(base + 5 * part_stat_stride, tl.max(tl.where(before, zm, -float("inf")), axis=1), mask=row_ok)
    hit = offs_n[None, :] == tgt[:, None]
    tz = tl.sum(tl.where(hit, z, 0.0), axis=1)
    blk_lo = v_lo + pid_n * BN
    mine = row_ok & (tgt >= blk_lo) & (tgt < blk_lo + BN) & (tgt < v_hi)
    tl.store(tlogit_ptr + offs_m, tz, mask=mine)


@triton.jit
def _bwd_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr,
                M, v_lo, v_hi, K, stride_h, stride_w, stride_dz,
                logit_scale, softcap, inv_t,
                HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_GE: tl.constexpr,
                COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                PERSISTENT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, DZ_TMA: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(v_hi - v_lo, BN)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
            _bwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr, pid_m, pid_n, M, v_lo,
                      v_hi, K, stride_h, stride_w, stride_dz, logit_scale, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP,
                      HAS_G, HAS_GE, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK, DZ_TMA)
    else:
        pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _bwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr, pid_m, pid_n, M, v_lo,
                  v_hi, K, stride_h, stride_w, stride_dz, logit_scale, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP,
                  HAS_G, HAS_GE, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK, DZ_TMA)


@triton.jit
def _bwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr, pid_m, pid_n,
              M, v_lo, v_hi, K, stride_h, stride_w, stride_dz,
              logit_scale, softcap, inv_t,
              HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_GE: tl.constexpr,
              COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DZ_TMA: tl.constexpr):
    """One [BM, BN] block of dZ: the logits recomputed, turned into their gradient, stored in the compute dtype."""
    z, t, offs_m, offs_n, row_ok, col_ok = _tile_logits(
        h_ptr, w_ptr, b_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h, stride_w, logit_scale, softcap, inv_t,
        HAS_BIAS, HAS_SOFTCAP, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK)
    log_z = tl.load(logz_ptr + offs_m, mask=row_ok, other=0.0)
    log_p = z - log_z[:, None]
    p = tl.exp(log_p)
    grad = tl.zeros((BM, BN), dtype=tl.float32)
    if HAS_G:
        g = tl.load(g_ptr + offs_m, mask=row_ok, other=0.0)
        tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1)
        hit = (offs_n[None, :] == tgt[:, None]).to(tl.float32)
        grad += g[:, None] * (hit - p)
    if HAS_GE:
        ge = tl.load(ge_ptr + offs_m, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_m, mask=row_ok, other=0.0)
        grad -= ge[:, None] * p * (log_p + ent[:, None])
    grad = grad * inv_t
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    grad = grad * logit_scale
    if DZ_TMA:  # dz_ptr is a descriptor of this [rows, chunk] tile: rows / columns past its edge are not written
        dz_ptr.store([pid_m * BM, pid_n * BN], grad.to(dz_ptr.dtype))
    else:
        ptrs = dz_ptr + offs_m.to(tl.int64)[:, None] * stride_dz + (offs_n - v_lo)[None, :]
        tl.store(ptrs, grad.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
               ACC: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr):
    """fp32 C (+)= A @ B with fp32 accumulation (used for the fp32 path's dX and dW with split-TF32 dots)."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + safe_m[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + safe_n[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        k_ok = rk + k * BK < K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn
    c_ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if ACC:
        acc += tl.load(c_ptrs, mask=c_ok, other=0.0)
    tl.store(c_ptrs, acc, mask=c_ok)


def _triton_mm_acc(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b, fp32, Triton with FP32_DOT products (any strides)."""
    m, k = a.shape
    n = b.shape[1]
    bm, bn, bk, group_m, warps, stages = CONFIGS["mm_32"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mm_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                     ACC=True, PRECISION=FP32_DOT, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps,
                     num_stages=stages)


def _dtype_key(compute: torch.dtype) -> str:
    return "32" if compute == torch.float32 else "16"


def _config(kind: str, compute: torch.dtype):
    return CONFIGS[f"{kind}_{_dtype_key(compute)}"]


def _precision(compute: torch.dtype) -> str:
    return FP32_DOT if compute == torch.float32 else "ieee"


def _mm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b in the compute dtype, accumulated in fp32 (no rounding of a @ b)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b accumulated in fp32 inside the GEMM, rounded once to out's dtype."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b, out_dtype=torch.float32) if out.dtype == torch.float32 else torch.mm(a, b))


def _operands(h, weight, compute, bm, bn, bk):
    """(h arg, w arg, use_tma): tensor descriptors when TMA is on and the layout allows it, else the tensors."""
    ok = (USE_TMA and h.dtype == compute and weight.dtype == compute and h.stride(1) == 1 and weight.stride(1) == 1
          and (h.stride(0) * h.element_size()) % 16 == 0 and (weight.stride(0) * weight.element_size()) % 16 == 0
          and h.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)
    if not ok:
        return h, weight, False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton without host-side tensor descriptors: the pointer path
        return h, weight, False

    return TensorDescriptor.from_tensor(h, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]), True


def _programs(kind: str, compute: torch.dtype, n_tiles: int, device: torch.device) -> tuple[int, bool]:
    """(grid size, persistent): one program per SM looping over the tiles, or one program per tile."""
    if not (PERSISTENT[f"{kind}_{_dtype_key(compute)}"] and _FLATTEN_OK):
        return n_tiles, False
    slots = PERSISTENT_PROGRAMS
    if slots is None:
        slots = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3
    return min(n_tiles, slots), True


def _dz_target(tile: torch.Tensor, bm: int, bn: int, tma_loads: bool):
    """(dz arg, use_tma): a tensor descriptor of the dZ tile when DZ_TMA is on and its layout allows it."""
    ok = (DZ_TMA[_dtype_key(tile.dtype)] and tma_loads and tile.stride(1) == 1
          and (tile.stride(0) * tile.element_size()) % 16 == 0 and tile.data_ptr() % 16 == 0)
    if not ok:
        return tile, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(tile, [bm, bn]), True


def _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want):
    """Running online-LSE statistics of the valid rows `h` over the whole vocabulary."""
    m_rows, k = h.shape
    vocab = weight.shape[0]
    dev = h.device
    bm, bn, bk, group_m, warps, stages = _config("fwd", compute)
    total_vblocks = triton.cdiv(vocab, bn)
    per_launch = max(1, min(total_vblocks, PART_BUDGET_BYTES // (m_rows * 4 * 6)))
    part = torch.empty((6, per_launch, m_rows), device=dev, dtype=torch.float32)
    run_m = torch.full((m_rows,), float("-inf"), device=dev)
    run_s = torch.zeros(m_rows, device=dev)
    run_xs = torch.zeros(m_rows, device=dev) if want["entropy"] else None
    run_sq = torch.zeros(m_rows, device=dev) if want["log_sum_sq_probs"] else None
    run_zs = torch.zeros(m_rows, device=dev) if want["mean_logits"] else None
    run_mbt = torch.full((m_rows,), float("-inf"), device=dev) if want["is_top1"] else None
    target_logit = torch.zeros(m_rows, device=dev)
    for vb0 in range(0, total_vblocks, per_launch):
        nvb = min(per_launch, total_vblocks - vb0)
        v_lo, v_hi = vb0 * bn, min(vocab, (vb0 + nvb) * bn)
        n_progs, persistent = _programs("fwd", compute, triton.cdiv(m_rows, bm) * nvb, dev)
        h_arg, w_arg, tma = _operands(h, weight, compute, bm, bn, bk)
        _fwd_kernel[(n_progs,)](
            h_arg, w_arg, bias if bias is not None else h, y, part, target_logit,
            m_rows, v_lo, v_hi, k, h.stride(0), weight.stride(0), part.stride(0),
            float(logit_scale), float(softcap or 1.0), float(inv_t),
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=want["entropy"],
            HAS_SQ=want["log_sum_sq_probs"], HAS_MEAN=want["mean_logits"], HAS_TOP1=want["is_top1"],
            COMPUTE=_TL_DTYPE[compute], PRECISION=_precision(compute), EVEN_K=k % bk == 0, USE_TMA=tma,
            BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PERSISTENT=persistent, NUM_PROGRAMS=n_progs,
            num_warps=warps, num_stages=stages)
        pm = part[0, :nvb]
        new_m = torch.maximum(run_m, pm.amax(0))
        alpha = torch.exp(run_m - new_m)
        w = torch.exp(pm - new_m)
        run_s = run_s * alpha + (part[1, :nvb] * w).sum(0)
        if run_xs is not None:
            run_xs = run_xs * alpha + (part[2, :nvb] * w).sum(0)
        if run_sq is not None:
            run_sq = run_sq * alpha * alpha + (part[3, :nvb] * w * w).sum(0)
        if run_zs is not None:
            run_zs = run_zs + part[4, :nvb].sum(0)
        if run_mbt is not None:
            run_mbt = torch.maximum(run_mbt, part[5, :nvb].amax(0))
        run_m = new_m
    return run_m, run_s, run_xs, run_sq, run_zs, run_mbt, target_logit


class FusedLinearLogProbFunction(torch.autograd.Function):
    """TRL `ChunkedLogProbFunction` calling convention (see `grpo_lab.backends.base`), CUDA + Triton."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, compute):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        inv_t = 1.0 / temperature
        want = {name: name in outputs for name in OPTIONAL_OUTPUTS}
        valid = targets >= 0
        n_valid = int(valid.sum())
        rows = None if n_valid == n else valid.nonzero().squeeze(-1)
        h = hidden if rows is None else hidden.index_select(0, rows)
        y = targets if rows is None else targets.index_select(0, rows)
        h = h.contiguous()
        y = y.contiguous()
        dev = hidden.device
        if n_valid > 0:
            m, s, xs, sq, zs, mbt, tlogit = _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute,
                                                           want)
            log_z = m + torch.log(s)
            logprobs = tlogit - log_z
            entropy = log_z - xs / s if want["entropy"] else None
            extras = (
                torch.log(sq) - 2 * torch.log(s) if want["log_sum_sq_probs"] else None,
                zs / vocab if want["mean_logits"] else None,
                (tlogit >= m) & (tlogit > mbt) if want["is_top1"] else None,
            )
        else:
            log_z = torch.zeros(0, device=dev)
            logprobs = torch.zeros(0, device=dev)
            entropy = torch.zeros(0, device=dev) if want["entropy"] else None
            extras = (
                torch.zeros(0, device=dev) if want["log_sum_sq_probs"] else None,
                torch.zeros(0, device=dev) if want["mean_logits"] else None,
                torch.zeros(0, device=dev, dtype=torch.bool) if want["is_top1"] else None,
            )
        ctx.save_for_backward(hidden, weight, bias, y, log_z, entropy if entropy is not None else log_z, rows)
        ctx.conf = (softcap, logit_scale, inv_t, compute, n_valid)

        def scatter(x):
            if x is None or rows is None:
                return x
            return x.new_zeros(n).index_copy(0, rows, x)

        outs = (scatter(logprobs), scatter(entropy), *map(scatter, extras))
        ctx.mark_non_differentiable(*(x for x in outs[2:] if x is not None))
        return outs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, bias, y, log_z, entropy, rows = ctx.saved_tensors
        softcap, logit_scale, inv_t, compute, n_valid = ctx.conf
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dev = hidden.device
        vocab, k = weight.shape
        if rows is not None:
            g = None if grad_logprobs is None else grad_logprobs.index_select(0, rows)
            ge = None if grad_entropy is None else grad_entropy.index_select(0, rows)
        else:
            g, ge = grad_logprobs, grad_entropy
        g = None if g is None else g.float().contiguous()
        ge = None if ge is None else ge.float().contiguous()
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(vocab, device=dev, dtype=torch.float32) if (need_b and bias is not None) else None
        grad_h_valid = torch.zeros((n_valid, k), device=dev, dtype=torch.float32) if need_h else None
        if n_valid > 0 and (g is not None or ge is not None) and (need_h or need_w or need_b):
            h = hidden if rows is None else hidden.index_select(0, rows)
            h = h.contiguous()
            h_c = h.to(compute)
            bm, bn, bk, group_m, warps, stages = _config("bwd", compute)
            tokens, vocab_tile = BWD_TILE[_dtype_key(compute)]
            t_tile = min(n_valid, tokens)
            v_tile = min(vocab, vocab_tile)
            dz = torch.empty((t_tile, v_tile), device=dev, dtype=compute)
            n_ttiles = triton.cdiv(n_valid, t_tile)
            dw_buf = None
            if need_w and n_ttiles > 1 and grad_w.dtype != torch.float32:
                dw_buf = torch.empty((v_tile, k), device=dev, dtype=torch.float32)
            dummy = log_z
            tri_mm = (FP32_MM == "triton" and compute == torch.float32 and weight.dtype == torch.float32
                      and h.dtype == torch.float32)
            for v0 in range(0, vocab, v_tile):
                v1 = min(v0 + v_tile, vocab)
                w_c = None if tri_mm else weight[v0:v1].to(compute)
                if dw_buf is not None:
                    dw_buf.zero_()
                for t0 in range(0, n_valid, t_tile):
                    t1 = min(t0 + t_tile, n_valid)
                    rows_t = t1 - t0
                    tile = dz[:rows_t, : v1 - v0]
                    n_progs, persistent = _programs("bwd", compute, triton.cdiv(rows_t, bm) * triton.cdiv(v1 - v0, bn),
                                                    dev)
                    h_arg, w_arg, tma = _operands(h[t0:t1], weight, compute, bm, bn, bk)
                    dz_arg, dz_tma = _dz_target(tile, bm, bn, tma)
                    _bwd_kernel[(n_progs,)](
                        h_arg, w_arg, bias if bias is not None else h, y[t0:t1], log_z[t0:t1],
                        entropy[t0:t1], g[t0:t1] if g is not None else dummy, ge[t0:t1] if ge is not None else dummy,
                        dz_arg, rows_t, v0, v1, k, h.stride(0), weight.stride(0), tile.stride(0),
                        float(logit_scale), float(softcap or 1.0), float(inv_t),
                        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_G=g is not None,
                        HAS_GE=ge is not None, COMPUTE=_TL_DTYPE[compute], PRECISION=_precision(compute),
                        EVEN_K=k % bk == 0, USE_TMA=tma, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                        PERSISTENT=persistent, NUM_PROGRAMS=n_progs, DZ_TMA=dz_tma,
                        num_warps=warps, num_stages=stages)
                    if tri_mm:
                        if need_h:
                            _triton_mm_acc(grad_h_valid[t0:t1], tile, weight[v0:v1])
                        if need_w:
                            _triton_mm_acc(grad_w[v0:v1], tile.t(), h[t0:t1])
                    if need_h and not tri_mm:
                        _mm_acc(grad_h_valid[t0:t1], tile, w_c)
                    if need_w and not tri_mm:
                        if n_ttiles == 1:
                            _mm_into(grad_w[v0:v1], tile.t(), h_c[t0:t1])
                        elif dw_buf is None:
                            _mm_acc(grad_w[v0:v1], tile.t(), h_c[t0:t1])
                        else:
                            _mm_acc(dw_buf[: v1 - v0], tile.t(), h_c[t0:t1])
                    if grad_b is not None:
                        grad_b[v0:v1] += tile.sum(0, dtype=torch.float32)
                if dw_buf is not None:
                    grad_w[v0:v1].copy_(dw_buf[: v1 - v0])
        grad_h = None
        if need_h:
            grad_h = grad_h_valid.to(hidden.dtype)
            if rows is not None:
                grad_h = torch.zeros_like(hidden).index_copy_(0, rows, grad_h)
        return (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None, None, None)


def fused_linear_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None,
                          logit_scale=1.0, outputs=("log_probs",)):
    """Per-token log-probs of `hidden @ weight.T (+ bias)` and the requested extras, never holding the logits.

    Same arguments and outputs as TRL's `ChunkedLogProbFunction.apply`; `chunk_size` is accepted for that
    signature and ignored (the tiles are this kernel's own). Under autocast the projection runs in the autocast
    dtype (inputs cast inside the kernel, no weight copy); accumulation is always fp32.
    """
    check_logprob_inputs(hidden, weight, bias, targets, temperature, outputs)
    if hidden.device.type != "cuda":
        raise ValueError("fused_linear_logprobs needs CUDA tensors; use grpo_lab.backends.chunked elsewhere.")
    compute = compute_dtype_of(hidden)
    if compute not in _TL_DTYPE:
        raise TypeError(f"unsupported compute dtype {compute}")
    weight_c = weight if weight.stride(-1) == 1 else weight.contiguous()
    hidden_c = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()  # the kernels index it densely
    with torch.autocast("cuda", enabled=False):
        return FusedLinearLogProbFunction.apply(hidden_c, weight_c, bias, targets.long(), float(temperature),
                                                chunk_size, softcap, float(logit_scale), tuple(outputs), compute)
