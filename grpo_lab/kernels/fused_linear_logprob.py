"""Fused linear -> per-token log-prob (+ entropy) on CUDA: Triton GEMM tiles with the softmax work in the epilogue.

Forward. One Triton matmul kernel computes `[BM tokens, BN vocab]` blocks of `hidden @ weight.T` in fp32 registers
(K = H loop, tensor cores for bf16/fp16, IEEE fp32 or split-TF32 ("tf32x3") for fp32) and, in the epilogue, applies
scale / softcap / temperature and reduces the block to per-row partial online-LSE statistics (max, sum of exps,
sum of exp·z for the entropy, ...). The logits never reach HBM: only `n_vblocks × N` partial stats do, for one
vocabulary chunk at a time (a fixed budget, so memory is flat in N); `_merge_kernel` folds them into running stats.

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

from grpo_lab.backends.base import (OPTIONAL_OUTPUTS, check_logprob_inputs, compute_dtype_of, entropy_grad_expected,
                                    frozen_coefficients, head_mode, note_entropy_grad, outputs_from_stats)

# Tile configuration per compute dtype: (BM, BN, BK, GROUP_M, num_warps, num_stages). Chosen on the H200 by
# benchmarks/loss_bench.py --tune (see docs/kernel.md); overridable for experiments.
CONFIGS = {
    "fwd_16": (128, 256, 64, 8, 8, 3),
    "bwd_16": (128, 256, 64, 8, 8, 3),
    "fwd_32": (128, 128, 32, 8, 8, 3),
    "bwd_32": (128, 128, 32, 8, 8, 3),
    "mm_32": (128, 128, 32, 8, 8, 3),
    # the frozen head's forward (statistics + the P~ store), tuned apart from the statistics-only forward
    # 128 x 128 x 64, 8 warps, 4 stages with P~ through descriptors: 42.7 vs 48.5 ms (128 x 256, 3 stages) at
    # H = 1024, 32k tokens, 138.5 vs 143.2 at H = 4096 (results/loss_kernel/tune_run4.csv)
    "frozen_16": (128, 128, 64, 8, 8, 4),
    "frozen_32": (128, 128, 32, 8, 8, 3),
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
# The partial-statistics merge: rows per program and vocabulary blocks per load of `_merge_kernel`.
MERGE_ROWS, MERGE_BLOCKS = 128, 32
# Persistent launch per fused kernel and dtype (keys as CONFIGS): one program per SM loops over the tiles, its loop
# flattened with the K loop so the next tile's loads are issued while this tile's softmax epilogue runs, instead of
# one program per tile.
# On by default for 16-bit: bf16 B=64 head fwd+bwd 71.7 vs 75.2 ms on the H200 (tune_run3.csv); fp32 gained nothing
# (662 vs 658 ms). GRPO_LAB_PERSISTENT, when set, lists the keys to turn on ("" for none). Needs a Triton whose
# `tl.range` has `flatten` (3.3+); older ones get the one-program-per-tile launch.
PERSISTENT = {key: False for key in CONFIGS if key.startswith(("fwd", "bwd"))}  # the frozen forward follows fwd
_PERSISTENT_ON = [k.strip() for k in os.environ.get("GRPO_LAB_PERSISTENT", "fwd_16,bwd_16").split(",") if k.strip()]
if set(_PERSISTENT_ON) - set(PERSISTENT):
    raise ValueError(f"GRPO_LAB_PERSISTENT={os.environ.get('GRPO_LAB_PERSISTENT')!r}: keys are {sorted(PERSISTENT)}")
PERSISTENT.update({key: True for key in _PERSISTENT_ON})
_FLATTEN_OK = "flatten" in inspect.signature(tl.range).parameters
# Programs of a persistent launch: None = one per SM (3 off CUDA, for Triton's interpreter), fewer when there are
# fewer tiles. The count is a compile-time constant: launches of under one program per SM compile their own variant
# (a bounded few: small token tiles and the last vocabulary chunk).
PERSISTENT_PROGRAMS = None
# Programs per SM of a persistent launch, per CONFIGS key: 2 lets two programs share an SM when their registers and
# shared memory allow it, so one's softmax epilogue can overlap the other's tensor-core work.
PROGRAMS_PER_SM = {key: 1 for key in CONFIGS}
# Extra Triton compile options per CONFIGS key (e.g. {"maxnreg": 128}, which lets two 8-warp programs fit one SM).
LAUNCH_OPTIONS = {key: {} for key in CONFIGS}
# The last launch of each fused kernel, as Triton compiled it (registers per thread, spills, shared memory): read by
# benchmarks/loss_bench.py --tune to say how many programs an SM can hold.
LAST_COMPILED = {}
# The backward writes dZ through a tensor descriptor (bulk store, clipped at the tile's edges) when TMA loads are on;
# per compute dtype. Off: no gain on the H200 (tune_run3.csv). GRPO_LAB_DZ_TMA=1 turns it on for both.
DZ_TMA = {key: os.environ.get("GRPO_LAB_DZ_TMA", "0") == "1" for key in ("16", "32")}
# The frozen forward stores its P~ blocks through a tensor descriptor (an asynchronous bulk copy from shared memory,
# which the next tile's loads can overlap) when TMA loads are on; per compute dtype. GRPO_LAB_P_TMA=0/1 sets both.
# On for 16-bit (with the frozen tiles above), off for fp32 (not measured there).
P_TMA = {key: os.environ.get("GRPO_LAB_P_TMA", default) == "1" for key, default in (("16", "1"), ("32", "0"))}
# fp32 dot: "ieee" (plain fp32 FMA) or "tf32x3" (three TF32 products, fp32-level error, on tensor cores)
FP32_DOT = os.environ.get("GRPO_LAB_FP32_DOT", "tf32x3")
# Frozen head (only the hidden states need a gradient): the two-GEMM path (forward accumulates Σ p·W, backward
# elementwise) unless GRPO_LAB_FROZEN=recompute asks for the trainable head's recomputing backward.
FROZEN_TWO_GEMM = os.environ.get("GRPO_LAB_FROZEN", "two_gemm") != "recompute"
# A frozen head with fewer than FROZEN_RECOMPUTE_ROWS valid rows and rows × hidden below FROZEN_RECOMPUTE_BELOW
# takes the recompute path (dX only) instead: at so few rows the step is bound by host work, and the two-GEMM path's
# extra launches and reductions cost more than its saved GEMM. H200, bf16, head fwd+bwd (tune_run4.csv,
# tune_run5.csv): recompute 3.8 / 5.2 / 6.4 / 5.6 ms against 4.6 / 5.7 / 7.3 / 5.9 at 2048 rows × H 1024 / 1536 /
# 2048 and 3072 × 1024; two-GEMM ahead from 3072 × 1536 (7.2 vs 7.6) and at 2048 × 4096 (9.8 vs 12.4); in the whole
# loss at 4096 × 1024 two-GEMM 7.7 ms, recompute 8.5 (TRL 8.0-8.2; loss_grid.csv). Its dZ tile keeps the frozen P~
# tile's budget (same memory).
FROZEN_RECOMPUTE_ROWS = {"16": 4096, "32": 0}
FROZEN_RECOMPUTE_BELOW = {"16": int(os.environ.get("GRPO_LAB_FROZEN_RECOMPUTE_BELOW", 9 * 2**19)), "32": 0}
# The frozen path's P~ buffer per compute dtype, (tokens, vocabulary): 128 MiB bf16 / 256 MiB fp32, widened in the
# vocabulary when there are fewer rows. (16384 x 8192 bf16 held the loss peak at 0.59 GiB at B = 64, H = 1024, over
# TRL's 0.44: results/loss_kernel, run 5.)
FROZEN_TILE = {"16": (8192, 8192), "32": (8192, 8192)}
# e^(z − ref) is stored against a per-row reference (the target's logit); rows whose max exceeds it by more than this
# are recomputed against their exact max (e^60 · V stays far inside the fp32 / bf16 range).
REF_HEADROOM = 60.0
# With an entropy gradient expected, P~·(z − ref) is rounded to the compute dtype before its GEMM, and the rebase
# B − (log Z − ref)·A cancels the largest entry's share of B: its rounding error, relative to A, is about
# p_max·(max − ref)·eps (bf16: 2^-9) — 5 % of dX for peaked rows whose target sits 20-60 nats below the max (the GPU
# test). Rows where p_max·(max − ref) exceeds this are recomputed against their max. With targets sampled from the
# policy, 2 rescues 4-7 % of rows and leaves dX within 1.7e-3 of float64 (tests/kernels/test_frozen_rebase_cpu.py);
# a plain 1-nat gap rule rescued 13-62 %. fp32 rounds 2^16 times finer: only the overflow guard applies there.
PLOGP_EXCESS = {"16": 2.0, "32": float("inf")}
# GiB the user allows a trainable head to keep for speed: its [N, V] probabilities in the compute dtype, so the
# backward needs no recompute (three GEMMs instead of four). 0 (the default): never; memory stays flat in N.
MATERIALIZE_GIB = float(os.environ.get("GRPO_LAB_MATERIALIZE_GIB", "0"))
# A forward that stores e^(z − ref) (frozen and materialised heads) takes its statistics against that same per-row
# ref instead of each block's max: the exponentials start as soon as the logits are there (no row max to reduce and
# broadcast first, fewer live registers) and the partial sums add without rescaling. The sums are brought back to
# the row max once at the end; a row whose max is over REF_HEADROOM above ref (where e^(z − ref) could overflow) is
# recomputed, statistics included, against its max as before. Per compute dtype; GRPO_LAB_REF_STATS=0/1 sets both.
REF_STATS = {key: os.environ.get("GRPO_LAB_REF_STATS", "1") == "1" for key in ("16", "32")}
# With REF_STATS, Σ e^(2(z − ref)) (log Σp², when asked for) overflows fp32 once the max is ~38 nats above ref
# (V·e^(2·gap) > 3.4e38), and its way back to the max multiplies by e^(−2·gap): rows with a larger gap than this are
# recomputed against their max when that statistic is wanted (the GPU test's peaked rows found it).
SQ_REF_HEADROOM = 30.0
# The statistics-only forward (a trainable head's, and old / reference log-probs) against the same kind of ref: the
# target's logit from a row-wise dot first, the same rescue after. Per compute dtype; GRPO_LAB_REF_STATS_PLAIN=0/1.
REF_STATS_PLAIN = {key: os.environ.get("GRPO_LAB_REF_STATS_PLAIN", "0") == "1" for key in ("16", "32")}

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
def _fwd_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr,
                M, v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p,
                logit_scale, softcap, inv_t,
                HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
                COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                PERSISTENT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, P_MODE: tl.constexpr,
                STORE_PZ: tl.constexpr, P_TMA: tl.constexpr, REF_STATS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(v_hi - v_lo, BN)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
            _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr, pid_m, pid_n, M,
                      v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p, logit_scale, softcap, inv_t,
                      HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY, HAS_SQ, HAS_MEAN, HAS_TOP1, COMPUTE, PRECISION, EVEN_K,
                      USE_TMA, BM, BN, BK, P_MODE, STORE_PZ, P_TMA, REF_STATS)
    else:
        pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr, pid_m, pid_n, M,
                  v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p, logit_scale, softcap, inv_t,
                  HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY, HAS_SQ, HAS_MEAN, HAS_TOP1, COMPUTE, PRECISION, EVEN_K,
                  USE_TMA, BM, BN, BK, P_MODE, STORE_PZ, P_TMA, REF_STATS)


@triton.jit
def _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr, pid_m, pid_n,
              M, v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p,
              logit_scale, softcap, inv_t,
              HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
              HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
              COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P_MODE: tl.constexpr, STORE_PZ: tl.constexpr,
              P_TMA: tl.constexpr, REF_STATS: tl.constexpr):
    """One [BM, BN] block: its logits, reduced to per-row partial statistics in `part`; with P_MODE, also the
    block's e^(z − ref) (ref: a per-row reference, `ref_ptr`) stored at `p_ptr` for a cuBLAS GEMM to consume —
    P_MODE 1 (frozen head): times the softcap factor, target column 0, and e^(z − ref)·(z − ref) at `pz_ptr` when
    STORE_PZ; P_MODE 2 (materialised head): e^(z − ref) as is. With P_TMA, `p_ptr` / `pz_ptr` are tensor
    descriptors of this launch's [rows, chunk] views (bulk stores, clipped at their edges). With REF_STATS (only
    with P_MODE), the partial sums are taken against ref rather than the block's max (which is still stored)."""
    z, t, offs_m, offs_n, row_ok, col_ok = _tile_logits(
        h_ptr, w_ptr, b_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h, stride_w, logit_scale, softcap, inv_t,
        HAS_BIAS, HAS_SOFTCAP, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK)
    zm = tl.where(col_ok[None, :], z, -float("inf"))
    if REF_STATS:
        ref = tl.load(ref_ptr + offs_m, mask=row_ok, other=0.0)
        e = tl.exp(zm - ref[:, None])  # e^(z − ref): no wait for the row max
        m = tl.max(zm, axis=1)
    else:
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
    if P_MODE != 0:  # last, so that e is dead once pe exists (one [BM, BN] fp32 block fewer live)
        if REF_STATS:
            pe = e
        else:
            ref = tl.load(ref_ptr + offs_m, mask=row_ok, other=0.0)
            pe = e * tl.exp(m - ref)[:, None]  # e^(z − ref); rows where that overflows are recomputed by the host
        if P_MODE == 1:
            if HAS_SOFTCAP:
                pe = pe * (1.0 - t * t)
            pe = tl.where(hit, 0.0, pe)
        if P_TMA:
            p_ptr.store([pid_m * BM, pid_n * BN], pe.to(p_ptr.dtype))
            if STORE_PZ:
                pz_ptr.store([pid_m * BM, pid_n * BN], (pe * (z - ref[:, None])).to(pz_ptr.dtype))
        else:
            p_off = offs_m.to(tl.int64)[:, None] * stride_p + (offs_n - v_lo)[None, :]
            p_ok = row_ok[:, None] & col_ok[None, :]
            tl.store(p_ptr + p_off, pe.to(p_ptr.dtype.element_ty), mask=p_ok)
            if STORE_PZ:
                tl.store(pz_ptr + p_off, (pe * (z - ref[:, None])).to(pz_ptr.dtype.element_ty), mask=p_ok)


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
def _dz_from_p_kernel(p_ptr, tgt_ptr, shift_ptr, lp_ptr, ent_ptr, g_ptr, ge_ptr, M, V, stride_p, scale,
                      HAS_G: tl.constexpr, HAS_GE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Materialised head's backward, in place: the stored e^(z − ref) becomes dZ. p_j = e^(z_j − ref)·e^(ref − log Z)
    (`shift` = ref − log Z per row); the target's own p_y and log p_y come from the fp32 log-prob, not from the
    rounded store, so 1 − p_y keeps its precision when p_y → 1."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = offs_m < M
    ok = row_ok[:, None] & (offs_n < V)[None, :]
    ptrs = p_ptr + offs_m.to(tl.int64)[:, None] * stride_p + offs_n[None, :]
    pe = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + offs_m, mask=row_ok, other=0.0)
    lp_y = tl.load(lp_ptr + offs_m, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1)
    hit = offs_n[None, :] == tgt[:, None]
    p = tl.where(hit, tl.exp(lp_y)[:, None], pe * tl.exp(shift)[:, None])
    grad = tl.zeros((BM, BN), dtype=tl.float32)
    if HAS_G:
        g = tl.load(g_ptr + offs_m, mask=row_ok, other=0.0)
        grad += g[:, None] * (hit.to(tl.float32) - p)
    if HAS_GE:
        ge = tl.load(ge_ptr + offs_m, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_m, mask=row_ok, other=0.0)
        log_p = tl.where(hit, lp_y[:, None], tl.log(tl.maximum(pe, 1e-38)) + shift[:, None])
        grad -= ge[:, None] * tl.where(p > 0, p * (log_p + ent[:, None]), 0.0)
    tl.store(ptrs, (grad * scale).to(p_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _frozen_dx_kernel(acc_ptr, w_ptr, y_ptr, cy_ptr, ca_ptr, cb_ptr, out_ptr, M, K, acc_plane, stride_w, stride_out,
                      HAS_B: tl.constexpr, COMPUTE: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """The frozen head's input gradient in one pass: out = coef_y·W_y + coef_a·A (+ coef_b·B), per row (the math:
    `grpo_lab.backends.base.frozen_input_grad`); W_y gathered by target and read as the projection saw it."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    r_ok = offs_r < M
    ok = r_ok[:, None] & (offs_h < K)[None, :]
    rows = offs_r.to(tl.int64)[:, None]
    y = tl.load(y_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
    w_y = tl.load(w_ptr + y[:, None] * stride_w + offs_h[None, :], mask=ok, other=0.0).to(COMPUTE).to(tl.float32)
    a = tl.load(acc_ptr + rows * K + offs_h[None, :], mask=ok, other=0.0)
    out = tl.load(cy_ptr + offs_r, mask=r_ok, other=0.0)[:, None] * w_y
    out += tl.load(ca_ptr + offs_r, mask=r_ok, other=0.0)[:, None] * a
    if HAS_B:
        b = tl.load(acc_ptr + acc_plane + rows * K + offs_h[None, :], mask=ok, other=0.0)
        out += tl.load(cb_ptr + offs_r, mask=r_ok, other=0.0)[:, None] * b
    tl.store(out_ptr + rows * stride_out + offs_h[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _merge_kernel(part_ptr, run_ptr, part_stat_stride, run_stat_stride, M, n_blocks,
                  HAS_ENTROPY: tl.constexpr, HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
                  BR: tl.constexpr, BV: tl.constexpr, REF_STATS: tl.constexpr):
    """Folds one launch's per-block partial statistics (`part`, [stat, block, row]) into the running ones (`run`,
    [stat, row]) in place: the online-LSE merge, one launch instead of a dozen torch ops per vocabulary chunk. With
    REF_STATS every sum is against the same per-row ref, so they add as they are (the max is still merged)."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = offs_r < M
    old_m = tl.load(run_ptr + offs_r, mask=r_ok, other=0.0)
    new_m = old_m
    for b0 in range(0, n_blocks, BV):
        offs_b = b0 + tl.arange(0, BV)
        ok = (offs_b < n_blocks)[:, None] & r_ok[None, :]
        pm = tl.load(part_ptr + offs_b[:, None] * M + offs_r[None, :], mask=ok, other=-float("inf"))
        new_m = tl.maximum(new_m, tl.max(pm, axis=0))
    if REF_STATS:
        alpha = tl.where(r_ok, 1.0, 0.0)
    else:
        alpha = tl.exp(old_m - new_m)
    at_s = run_ptr + run_stat_stride + offs_r  # all six running statistics exist; the unwanted ones stay untouched
    s = tl.load(at_s, mask=r_ok, other=0.0) * alpha
    xs = tl.load(at_s + run_stat_stride, mask=r_ok, other=0.0) * alpha
    sq = tl.load(at_s + 2 * run_stat_stride, mask=r_ok, other=0.0) * alpha * alpha
    zs = tl.load(at_s + 3 * run_stat_stride, mask=r_ok, other=0.0)
    mbt = tl.load(at_s + 4 * run_stat_stride, mask=r_ok, other=-float("inf"))
    for b0 in range(0, n_blocks, BV):
        offs_b = b0 + tl.arange(0, BV)
        ok = (offs_b < n_blocks)[:, None] & r_ok[None, :]
        at = part_ptr + offs_b[:, None] * M + offs_r[None, :]
        if REF_STATS:
            w = tl.where(ok, 1.0, 0.0)
        else:
            w = tl.exp(tl.load(at, mask=ok, other=-float("inf")) - new_m[None, :])
            w = tl.where(ok, w, 0.0)
        s += tl.sum(tl.load(at + part_stat_stride, mask=ok, other=0.0) * w, axis=0)
        if HAS_ENTROPY:
            xs += tl.sum(tl.load(at + 2 * part_stat_stride, mask=ok, other=0.0) * w, axis=0)
        if HAS_SQ:
            sq += tl.sum(tl.load(at + 3 * part_stat_stride, mask=ok, other=0.0) * w * w, axis=0)
        if HAS_MEAN:
            zs += tl.sum(tl.load(at + 4 * part_stat_stride, mask=ok, other=0.0), axis=0)
        if HAS_TOP1:
            mbt = tl.maximum(mbt, tl.max(tl.load(at + 5 * part_stat_stride, mask=ok, other=-float("inf")), axis=0))
    tl.store(run_ptr + offs_r, new_m, mask=r_ok)
    tl.store(at_s, s, mask=r_ok)
    if HAS_ENTROPY:
        tl.store(at_s + run_stat_stride, xs, mask=r_ok)
    if HAS_SQ:
        tl.store(at_s + 2 * run_stat_stride, sq, mask=r_ok)
    if HAS_MEAN:
        tl.store(at_s + 3 * run_stat_stride, zs, mask=r_ok)
    if HAS_TOP1:
        tl.store(at_s + 4 * run_stat_stride, mbt, mask=r_ok)


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


def _forward_kind(sink) -> str:
    """The CONFIGS family of a forward launch: the frozen head's (it also stores P~) or the statistics-only one."""
    return "frozen" if sink is not None and sink.p_mode == 1 else "fwd"


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
    """(grid size, persistent): PROGRAMS_PER_SM programs per SM looping over the tiles, or one program per tile.
    The frozen forward follows the statistics forward's PERSISTENT switch."""
    key = f"{kind}_{_dtype_key(compute)}"
    if not (PERSISTENT[key.replace("frozen", "fwd")] and _FLATTEN_OK):
        return n_tiles, False
    slots = PERSISTENT_PROGRAMS
    if slots is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3
        slots = sms * PROGRAMS_PER_SM[key]
    return min(n_tiles, slots), True


def _dz_target(tile: torch.Tensor, bm: int, bn: int, tma_loads: bool):
    """(dz arg, use_tma): a tensor descriptor of the dZ tile when DZ_TMA is on and its layout allows it."""
    return _store_target(tile, bm, bn, DZ_TMA[_dtype_key(tile.dtype)] and tma_loads)


def _store_target(tile: torch.Tensor, bm: int, bn: int, wanted: bool):
    """(arg, use_tma): a [bm, bn]-block tensor descriptor of `tile` when wanted and its layout allows bulk stores."""
    ok = (wanted and tile.stride(1) == 1 and (tile.stride(0) * tile.element_size()) % 16 == 0
          and tile.data_ptr() % 16 == 0)
    if not ok:
        return tile, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(tile, [bm, bn]), True


def _widened_vocab_tile(vocab: int, tokens: int, vocab_tile: int, rows: int, bn: int) -> int:
    """Vocabulary width of a [rows, width] buffer whose budget is tokens × vocab_tile elements: wider when fewer rows
    than `tokens` are there (fewer, larger launches and GEMMs at small N, same memory), a multiple of BN."""
    width = max(vocab_tile, (tokens * vocab_tile // max(rows, 1)) // bn * bn)
    return min(width, vocab)


class _FrozenSink:
    """Frozen head: each [token tile, vocab chunk] block of P~ = c·e^(z − ref) (target column 0) goes through a
    reusable buffer into acc[0][tile] += P~ @ W[chunk] (cuBLAS, fp32 accumulation); with `with_plogp`, also
    P~·(z − ref) into acc[1]. The second GEMM of the two-GEMM frozen path."""

    p_mode = 1

    def __init__(self, m_rows, weight, compute, ref, with_plogp, bn):
        tokens, vocab_tile = FROZEN_TILE[_dtype_key(compute)]
        self.t_tile = min(m_rows, tokens)
        self.v_tile = _widened_vocab_tile(weight.shape[0], tokens, vocab_tile, self.t_tile, bn)
        depth = 2 if with_plogp else 1
        self.buf = torch.empty((depth, self.t_tile, self.v_tile), device=ref.device, dtype=compute)
        self.acc = torch.zeros((depth, m_rows, weight.shape[1]), device=ref.device, dtype=torch.float32)
        self.weight, self.compute, self.ref = weight, compute, ref

    def views(self, t0, t1, v0, v1, bm, bn, tma_loads):
        """(p, pz, ref rows, row stride, store pz, through descriptors) for the launch on rows t0:t1 and vocabulary
        v0:v1: the buffer's planes, or descriptors of their [rows, chunk] views (P_TMA)."""
        p, pz = self.buf[0], self.buf[-1]
        if P_TMA[_dtype_key(self.compute)] and tma_loads:
            (p, tma_p), (pz, tma_pz) = (_store_target(x[: t1 - t0, : v1 - v0], bm, bn, True) for x in (p, pz))
            if tma_p and tma_pz:
                return p, pz, self.ref[t0:t1], self.buf.stride(1), self.buf.shape[0] == 2, True
            p, pz = self.buf[0], self.buf[-1]
        return p, pz, self.ref[t0:t1], self.buf.stride(1), self.buf.shape[0] == 2, False

    def consume(self, t0, t1, v0, v1):
        w_c = self.weight[v0:v1].to(self.compute)
        for i in range(self.buf.shape[0]):
            _mm_acc(self.acc[i, t0:t1], self.buf[i, : t1 - t0, : v1 - v0], w_c)


class _RefSink:
    """No stores: only the per-row ref the statistics are taken against (`REF_STATS_PLAIN`)."""

    p_mode = 0
    t_tile = None
    v_tile = None

    def __init__(self, ref):
        self.ref = ref

    def views(self, t0, t1, v0, v1, bm, bn, tma_loads):
        return self.ref, self.ref, self.ref[t0:t1], 0, False, False

    def consume(self, t0, t1, v0, v1):
        pass


class _MaterializedSink:
    """Trainable head with memory allowed for speed: e^(z − ref) of every row and vocabulary entry is kept
    (`full`, [rows, V] in the compute dtype), so the backward is an elementwise pass and two GEMMs, no recompute."""

    p_mode = 2
    t_tile = None  # all rows per launch; the vocabulary chunk follows the statistics budget
    v_tile = None

    def __init__(self, full, ref):
        self.full, self.ref = full, ref

    def views(self, t0, t1, v0, v1, bm, bn, tma_loads):
        view = self.full[t0:t1, v0:]
        return view, view, self.ref[t0:t1], self.full.stride(0), False, False

    def consume(self, t0, t1, v0, v1):
        pass


def _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, sink=None):
    """Running online-LSE statistics of the valid rows `h` over the whole vocabulary (and, with a sink, its P~
    blocks handed over launch by launch)."""
    m_rows, k = h.shape
    vocab = weight.shape[0]
    dev = h.device
    kind = _forward_kind(sink)
    bm, bn, bk, group_m, warps, stages = _config(kind, compute)
    t_tile = (sink.t_tile if sink is not None else None) or m_rows
    v_tile = (sink.v_tile if sink is not None else None) or bn * max(
        1, min(triton.cdiv(vocab, bn), PART_BUDGET_BYTES // (t_tile * 4 * 6)))
    part = torch.empty((6, triton.cdiv(min(v_tile, vocab), bn) * t_tile), device=dev, dtype=torch.float32)
    run = torch.zeros((6, m_rows), device=dev)  # max, Σexp, Σexp·z, Σexp², Σz, max before the target
    run[0].fill_(float("-inf"))
    run[5].fill_(float("-inf"))
    target_logit = torch.zeros(m_rows, device=dev)
    flags = dict(HAS_ENTROPY=want["entropy"], HAS_SQ=want["log_sum_sq_probs"], HAS_MEAN=want["mean_logits"],
                 HAS_TOP1=want["is_top1"])
    ref_stats = sink is not None and (sink.p_mode == 0 or REF_STATS[_dtype_key(compute)])
    for t0 in range(0, m_rows, t_tile):
        t1 = min(m_rows, t0 + t_tile)
        rows = t1 - t0
        h_arg, w_arg, tma = _operands(h[t0:t1], weight, compute, bm, bn, bk)
        run_t = run[:, t0:t1]
        for v0 in range(0, vocab, v_tile):
            v1 = min(vocab, v0 + v_tile)
            nvb = triton.cdiv(v1 - v0, bn)
            n_progs, persistent = _programs(kind, compute, triton.cdiv(rows, bm) * nvb, dev)
            p, pz, ref, stride_p, store_pz, p_tma = sink.views(t0, t1, v0, v1, bm, bn, tma) if sink else (
                part, part, part, 0, False, False)
            compiled = _fwd_kernel[(n_progs,)](
                h_arg, w_arg, bias if bias is not None else h, y[t0:t1], part, target_logit[t0:t1], p, pz, ref,
                rows, v0, v1, k, h.stride(0), weight.stride(0), part.stride(0), stride_p,
                float(logit_scale), float(softcap or 1.0), float(inv_t),
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, **flags,
                COMPUTE=_TL_DTYPE[compute], PRECISION=_precision(compute), EVEN_K=k % bk == 0, USE_TMA=tma,
                BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PERSISTENT=persistent, NUM_PROGRAMS=n_progs,
                P_MODE=sink.p_mode if sink is not None else 0, STORE_PZ=store_pz, P_TMA=p_tma, REF_STATS=ref_stats,
                num_warps=warps, num_stages=stages, **LAUNCH_OPTIONS[f"{kind}_{_dtype_key(compute)}"])
            LAST_COMPILED[f"{kind}_{_dtype_key(compute)}"] = compiled
            _merge_kernel[(triton.cdiv(rows, MERGE_ROWS),)](
                part, run_t, part.stride(0), run_t.stride(0), rows, nvb, **flags, BR=MERGE_ROWS, BV=MERGE_BLOCKS,
                REF_STATS=ref_stats, num_warps=4)
            if sink is not None:
                sink.consume(t0, t1, v0, v1)
    if ref_stats:  # the sums against ref → against the row max, as the rest of the module expects
        to_max = torch.exp(sink.ref - run[0])
        run[1:3].mul_(to_max)
        run[3].mul_(to_max * to_max)
    return (run[0], run[1], run[2] if want["entropy"] else None, run[3] if want["log_sum_sq_probs"] else None,
            run[4] if want["mean_logits"] else None, run[5] if want["is_top1"] else None, target_logit)


def _reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale):
    """Each row's target logit, cheaply (a row-wise dot in the compute dtype): the reference e^(z − ref) is taken
    against. Any value ≤ the row's max does (no overflow unless the max is REF_HEADROOM above it, and such rows are
    recomputed against their exact max); the target's own logit is close to the max for sampled tokens."""
    out = torch.empty(h.shape[0], device=h.device)
    for r0 in range(0, h.shape[0], 8192):
        r1 = min(r0 + 8192, h.shape[0])
        w_rows = weight.index_select(0, y[r0:r1]).to(compute)
        z = torch.bmm(h[r0:r1].to(compute).unsqueeze(1), w_rows.unsqueeze(2)).view(-1).float()
        if bias is not None:
            z = z + bias.index_select(0, y[r0:r1]).to(compute).float()
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        out[r0:r1] = z * inv_t
    return out


def _frozen_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, with_plogp):
    """Statistics + A (+ B) of the frozen head, relative to log Z (see `base.frozen_input_grad`)."""
    bn = _config("frozen", compute)[1]
    ref = _reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale)
    sink = _FrozenSink(h.shape[0], weight, compute, ref, with_plogp, bn)
    stats = _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, sink)
    run_m, run_s = stats[0], stats[1]
    rows = _rows_to_recompute(run_m, run_s, ref, sink.acc, compute, _ref_limit(compute, want))
    if rows.numel():
        redo = _redo_rows(rows, stats, ref, lambda r: _FrozenSink(rows.numel(), weight, compute, r, with_plogp, bn),
                          h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
        sink.acc.index_copy_(1, rows, redo.acc)
    return stats, _rebase_to_log_z(sink.acc, run_m, run_s, ref)


def _statistics_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want):
    """The statistics-only forward; with REF_STATS_PLAIN against each row's target logit, rows too far below their
    max recomputed against it."""
    if not REF_STATS_PLAIN[_dtype_key(compute)]:
        return _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
    ref = _reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale)
    stats = _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, _RefSink(ref))
    rows = _far_below_max(stats[0], ref, _ref_limit(compute, want, True)).nonzero().squeeze(-1)
    if rows.numel():
        _redo_rows(rows, stats, ref, _RefSink, h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
    return stats


def _far_below_max(run_m, ref, limit):
    """Rows whose max sits more than `limit` above their ref (or is not a number): e^(z − ref) may overflow there."""
    return ~(run_m - ref <= limit)


def _redo_rows(rows, stats, ref, make_sink, h, weight, bias, y, inv_t, softcap, logit_scale, compute, want):
    """Recomputes `rows` against their exact max, which cannot overflow: `ref` is set to it, the rows' statistics
    replace the first pass's (against ref, an overflowing row's sums are not usable), and the sink made by
    `make_sink(ref of the rows)` holds their stores for the caller to put in place."""
    ref[rows] = stats[0][rows]
    sink = make_sink(ref[rows])
    redone = _forward_stats(h[rows], weight, bias, y[rows], inv_t, softcap, logit_scale, compute, want, sink)
    for kept, new in zip(stats, redone):
        if kept is not None:
            kept.index_copy_(0, rows, new)
    return sink


def _ref_limit(compute: torch.dtype, want: dict, against_ref: bool | None = None) -> float:
    """How far a row's max may sit above its ref before the row is recomputed against its max (`against_ref`: the
    statistics were taken against ref; REF_STATS by default)."""
    if against_ref is None:
        against_ref = REF_STATS[_dtype_key(compute)]
    if against_ref and want["log_sum_sq_probs"]:
        return min(REF_HEADROOM, SQ_REF_HEADROOM)
    return REF_HEADROOM


def _rows_to_recompute(run_m, run_s, ref, acc, compute, limit=None):
    """Rows whose P~ was stored too far below their max (overflow risk: `limit`, REF_HEADROOM by default; with B,
    its rounding: `PLOGP_EXCESS`, where p_max = 1 / run_s) or whose accumulators are not finite. One host sync."""
    limit = REF_HEADROOM if limit is None else limit
    gap = run_m - ref
    bad = _far_below_max(run_m, ref, limit) | ~torch.isfinite(acc.sum(-1)).all(0)  # an inf / nan row sums to one
    if acc.shape[0] == 2:
        bad |= gap / run_s > PLOGP_EXCESS[_dtype_key(compute)]
    return bad.nonzero().squeeze(-1)


def _rebase_to_log_z(acc, run_m, run_s, ref):
    """A_rel = Σ P~·W and B_rel = Σ P~·(z − ref)·W (against ref) → A = Σ p·W and B = Σ p·log p·W, in place."""
    log_sum = run_m - ref + torch.log(run_s)  # log Z − ref
    if acc.shape[0] == 2:  # B = f·(B_rel − (log Z − ref)·A_rel)
        acc[1].addcmul_(acc[0], -log_sum.unsqueeze(-1))
    acc.mul_(torch.exp(-log_sum).view(1, -1, 1))
    return acc


def _materialized_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want):
    """Statistics + the kept [rows, V] e^(z − ref) of a materialised head, and ref − log Z per row."""
    ref = _reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale)
    full = torch.empty((h.shape[0], weight.shape[0]), device=h.device, dtype=compute)
    stats = _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, _MaterializedSink(full, ref))
    run_m, run_s = stats[0], stats[1]
    rows = _far_below_max(run_m, ref, _ref_limit(compute, want)).nonzero().squeeze(-1)
    if rows.numel():
        redo = _redo_rows(rows, stats, ref, lambda r: _MaterializedSink(
            torch.empty((rows.numel(), weight.shape[0]), device=h.device, dtype=compute), r),
            h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
        full.index_copy_(0, rows, redo.full)
    return stats, full, ref - (run_m + torch.log(run_s))


def materialize_fits(n_rows: int, vocab: int, compute: torch.dtype, device: torch.device) -> bool:
    """Whether a trainable head may keep its [rows, V] probabilities: the user allowed that much memory
    (MATERIALIZE_GIB / GRPO_LAB_MATERIALIZE_GIB, 0 by default) and the device has it free, with 2 GiB to spare."""
    need = n_rows * vocab * torch.empty((), dtype=compute).element_size()
    if need > MATERIALIZE_GIB * 2**30:
        return False
    free, _ = torch.cuda.mem_get_info(device) if device.type == "cuda" else (need + 2**31, None)
    return need + 2**31 <= free


def _choose_path(mode: str, compute: torch.dtype, softcap, n_valid: int, vocab: int, device, hidden: int) -> str:
    """`stats` (no gradient), `frozen` (two GEMMs), `materialized` (three, memory allowed) or `recompute` (four; three
    for a frozen head, which needs no weight gradient)."""
    if mode == "inference" or n_valid == 0:
        return "stats"
    if mode == "frozen":
        key = _dtype_key(compute)
        small = n_valid < FROZEN_RECOMPUTE_ROWS[key] and n_valid * hidden < FROZEN_RECOMPUTE_BELOW[key]
        return "frozen" if FROZEN_TWO_GEMM and compute != torch.float16 and not small else "recompute"
    if softcap is None and compute != torch.float16 and materialize_fits(n_valid, vocab, compute, device):
        return "materialized"
    return "recompute"


class FusedLinearLogProbFunction(torch.autograd.Function):
    """TRL `ChunkedLogProbFunction` calling convention (see `grpo_lab.backends.base`), CUDA + Triton.

    Three ways to the gradient, chosen by `_choose_path` from the head mode (`base.head_mode`) and the memory the
    user allows: `frozen` (the head needs no gradient: the forward accumulates Σ p·W, the backward is elementwise),
    `materialized` (opt-in: the forward keeps every probability, the backward is two cuBLAS GEMMs) and `recompute`
    (the default for a trainable head: the backward recomputes the logits tile by tile, memory flat in N)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, compute,
                mode):
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
        path = _choose_path(mode, compute, softcap, n_valid, vocab, dev, hidden.shape[1])
        ctx.path, ctx.extra, ctx.mode = path, None, mode
        if n_valid > 0:
            if path == "frozen":
                with_plogp = want["entropy"] and entropy_grad_expected()
                stats, acc = _frozen_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want,
                                             with_plogp)
            elif path == "materialized":
                stats, full, shift = _materialized_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute,
                                                           want)
            else:
                stats = _statistics_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
            log_z, logprobs, entropy, extras = outputs_from_stats(*stats, vocab, want)
            if path == "frozen":
                ctx.extra = (acc, logprobs.clone(), stats[-1])  # the target logit (softcap factor of the target)
            elif path == "materialized":
                ctx.extra = (full, logprobs.clone(), shift)
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
        ctx.conf = (softcap, logit_scale, inv_t, compute, n_valid, entropy is not None)

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
        softcap, logit_scale, inv_t, compute, n_valid, has_entropy = ctx.conf
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dev = hidden.device
        if rows is not None:
            g = None if grad_logprobs is None else grad_logprobs.index_select(0, rows)
            ge = None if grad_entropy is None else grad_entropy.index_select(0, rows)
        else:
            g, ge = grad_logprobs, grad_entropy
        g = None if g is None else g.float().contiguous()
        ge = None if ge is None else ge.float().contiguous()
        grads = None
        if ctx.path == "frozen":
            note_entropy_grad(ge is not None)
            acc, logprobs, tlogit = ctx.extra
            if ge is None or acc.shape[0] == 2:  # else: an entropy gradient the forward did not prepare for
                grads = (_frozen_backward(hidden, weight, y, g, ge, acc, logprobs, entropy if has_entropy else None,
                                          tlogit, softcap, logit_scale, inv_t, compute, rows), None, None)
        elif ctx.path == "materialized" and n_valid > 0 and (g is not None or ge is not None):
            grads = _materialized_backward(ctx.extra, hidden, weight, bias, y, g, ge, entropy, logit_scale * inv_t,
                                           compute, rows, need_h, need_w, need_b)
        if grads is None:
            tile = (FROZEN_TILE if ctx.mode == "frozen" else BWD_TILE)[_dtype_key(compute)]
            grads = _recompute_backward(hidden, weight, bias, y, log_z, entropy, g, ge, rows, softcap, logit_scale,
                                        inv_t, compute, n_valid, need_h, need_w, need_b, tile)
        ctx.extra = None
        grad_h, grad_w, grad_b = grads
        return (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None, None, None, None)


def _scatter_rows(valid_grad, hidden, rows):
    if rows is None:
        return valid_grad
    return torch.zeros_like(hidden).index_copy_(0, rows, valid_grad.to(hidden.dtype))


def _frozen_backward(hidden, weight, y, g, ge, acc, logprobs, entropy, tlogit, softcap, logit_scale, inv_t, compute,
                     rows):
    """dX of the frozen path: elementwise from A, B and the statistics (`base.frozen_input_grad`)."""
    if logprobs.numel() == 0:
        return torch.zeros_like(hidden)
    c_target = torch.ones_like(logprobs)
    if softcap is not None:
        t_y = tlogit / (softcap * inv_t)
        c_target = 1 - t_y * t_y
    n, k = logprobs.shape[0], hidden.shape[1]
    out = torch.empty((n, k), device=hidden.device, dtype=hidden.dtype)
    coef_y, coef_a, coef_b = frozen_coefficients(g, ge, logprobs, entropy, c_target, inv_t * logit_scale)
    br, bh = 32, 128
    _frozen_dx_kernel[(triton.cdiv(n, br), triton.cdiv(k, bh))](
        acc, weight, y, coef_y.contiguous(), coef_a.contiguous(), coef_b.contiguous(), out, n, k, acc.stride(0),
        weight.stride(0), out.stride(0), HAS_B=acc.shape[0] == 2, COMPUTE=_TL_DTYPE[compute], BR=br, BH=bh,
        num_warps=4)
    return _scatter_rows(out, hidden, rows)


def _materialized_backward(extra, hidden, weight, bias, y, g, ge, entropy, scale, compute, rows, need_h, need_w,
                           need_b):
    """dZ from the kept probabilities (in place), then cuBLAS: dX = dZ @ W, dW = dZᵀ @ X, db = Σ dZ."""
    full, logprobs, shift = extra
    m_rows, vocab = full.shape
    bm, bn = 64, 128
    dummy = logprobs
    _dz_from_p_kernel[(triton.cdiv(m_rows, bm), triton.cdiv(vocab, bn))](
        full, y, shift, logprobs, entropy, g if g is not None else dummy, ge if ge is not None else dummy,
        m_rows, vocab, full.stride(0), float(scale), HAS_G=g is not None, HAS_GE=ge is not None, BM=bm, BN=bn,
        num_warps=4)
    grad_h = grad_w = grad_b = None
    if need_h:
        w_c = weight.to(compute)
        grad_h = torch.mm(full, w_c) if compute == torch.float32 else torch.mm(full, w_c, out_dtype=torch.float32)
        grad_h = _scatter_rows(grad_h.to(hidden.dtype), hidden, rows)
    if need_w:
        h = hidden if rows is None else hidden.index_select(0, rows)
        grad_w = torch.empty_like(weight)
        _mm_into(grad_w, full.t(), h.to(compute))
    if need_b and bias is not None:
        grad_b = full.sum(0, dtype=torch.float32)
    return grad_h, grad_w, grad_b


def _recompute_backward(hidden, weight, bias, y, log_z, entropy, g, ge, rows, softcap, logit_scale, inv_t, compute,
                        n_valid, need_h, need_w, need_b, dz_tile):
    """The memory-lean backward: recompute each [token tile, vocabulary chunk] of logits in the fused kernel, write
    dZ once into a `dz_tile` (tokens, vocabulary) buffer, then cuBLAS for dX and dW (vocabulary-outer, so each
    chunk's weight gradient is finished at once)."""
    dev = hidden.device
    vocab, k = weight.shape
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros(vocab, device=dev, dtype=torch.float32) if (need_b and bias is not None) else None
    grad_h_valid = torch.zeros((n_valid, k), device=dev, dtype=torch.float32) if need_h else None
    if n_valid > 0 and (g is not None or ge is not None) and (need_h or need_w or need_b):
        h = hidden if rows is None else hidden.index_select(0, rows)
        h = h.contiguous()
        h_c = h.to(compute)
        bm, bn, bk, group_m, warps, stages = _config("bwd", compute)
        tokens, vocab_tile = dz_tile
        t_tile = min(n_valid, tokens)
        v_tile = _widened_vocab_tile(vocab, tokens, vocab_tile, t_tile, bn)
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
                compiled = _bwd_kernel[(n_progs,)](
                    h_arg, w_arg, bias if bias is not None else h, y[t0:t1], log_z[t0:t1],
                    entropy[t0:t1], g[t0:t1] if g is not None else dummy, ge[t0:t1] if ge is not None else dummy,
                    dz_arg, rows_t, v0, v1, k, h.stride(0), weight.stride(0), tile.stride(0),
                    float(logit_scale), float(softcap or 1.0), float(inv_t),
                    HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_G=g is not None,
                    HAS_GE=ge is not None, COMPUTE=_TL_DTYPE[compute], PRECISION=_precision(compute),
                    EVEN_K=k % bk == 0, USE_TMA=tma, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                    PERSISTENT=persistent, NUM_PROGRAMS=n_progs, DZ_TMA=dz_tma,
                    num_warps=warps, num_stages=stages, **LAUNCH_OPTIONS[f"bwd_{_dtype_key(compute)}"])
                LAST_COMPILED[f"bwd_{_dtype_key(compute)}"] = compiled
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
        grad_h = _scatter_rows(grad_h_valid.to(hidden.dtype), hidden, rows)
    return grad_h, grad_w, grad_b


def fused_linear_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=None, softcap=None,
                          logit_scale=1.0, outputs=("log_probs",)):
    """Per-token log-probs of `hidden @ weight.T (+ bias)` and the requested extras, never holding the logits.

    Same arguments and outputs as TRL's `ChunkedLogProbFunction.apply`; `chunk_size` is accepted for that
    signature and ignored (the tiles are this kernel's own). Under autocast the projection runs in the autocast
    dtype (inputs cast inside the kernel, no weight copy); accumulation is always fp32. A head that needs no gradient
    (PEFT / LoRA, `requires_grad=False`) takes the two-GEMM frozen path automatically.
    """
    check_logprob_inputs(hidden, weight, bias, targets, temperature, outputs)
    if hidden.device.type != "cuda":
        raise ValueError("fused_linear_logprobs needs CUDA tensors; use grpo_lab.backends.chunked elsewhere.")
    compute = compute_dtype_of(hidden)
    if compute not in _TL_DTYPE:
        raise TypeError(f"unsupported compute dtype {compute}")
    mode = head_mode(hidden, weight, bias)
    weight_c = weight if weight.stride(-1) == 1 else weight.contiguous()
    hidden_c = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()  # the kernels index it densely
    with torch.autocast("cuda", enabled=False):
        return FusedLinearLogProbFunction.apply(hidden_c, weight_c, bias, targets.long(), float(temperature),
                                                chunk_size, softcap, float(logit_scale), tuple(outputs), compute, mode)
