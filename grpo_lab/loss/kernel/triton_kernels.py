"""The Triton kernels of the fused linear → log-prob head: every `@triton.jit` function, and nothing else.

This is the largest module of `grpo_lab.loss` on purpose: it is one idea (the device code), and splitting the
kernels from the tile helpers they inline would only scatter them. The host side that picks a path, sizes the
buffers and launches these lives in `launch`; the tile sizes and switches they are launched with in `tuning`.

Forward (`fwd_kernel`). One Triton matmul kernel computes `[BM tokens, BN vocab]` blocks of `hidden @ weight.T` in
fp32 registers (K = H loop, tensor cores for bf16/fp16, IEEE fp32 or split-TF32 ("tf32x3") for fp32) and, in the
epilogue, applies scale / softcap / temperature and reduces the block to per-row partial online-LSE statistics (max,
sum of exps, sum of exp·z for the entropy, ...). The logits never reach HBM: only `n_vblocks × N` partial stats do,
for one vocabulary chunk at a time; `merge_kernel` folds them into running stats. A frozen or materialised head also
stores the block's e^(z − ref) for a cuBLAS GEMM to consume.

Backward (`bwd_kernel`). The same GEMM recomputes the logits of a `[token tile, vocab chunk]` tile and its epilogue
turns them into the logits gradient `dL/dz_j = (1/T)·[g·(δ_jy − p_j) − h·p_j·(log p_j + H)]` (through softcap and
scale), written once in the compute dtype. `dz_from_p_kernel` does the same from kept probabilities,
`frozen_dx_kernel` is the frozen head's elementwise input gradient; `nt_mm_kernel` the fp32 path's split-TF32 GEMM on
K-major operands and `mm_kernel` its pointer fallback.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    if HAS_SOFTCAP:
        z = acc * logit_scale
        t = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0  # tanh(z / softcap)
        z = softcap * t * inv_t
    else:
        t = acc
        z = acc * (logit_scale * inv_t)  # one multiply per element (the host-side product is the same for all)
    return z, t, offs_m, offs_n, row_ok, col_ok


@triton.jit
def _exp(x, FAST: tl.constexpr):
    """e^x. FAST (on a GPU): one `ex2.approx.ftz` after the multiply by log2(e), where `tl.exp` adds a denormal-safe
    rescale around it (a compare and two predicated multiplies per element, a sixth of the forward's epilogue).
    Results under 2^-126 become 0: terms of sums whose largest term is at least 1 (against the max or the target's
    logit), so never visible in fp32. Off in Triton's interpreter, which runs no inline PTX."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % size_m
    pid_n = (pid % group_size) // size_m
    return pid_m, pid_n


@triton.jit
def fwd_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr,
               M, v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p,
               logit_scale, softcap, inv_t,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
               HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
               COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               PERSISTENT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, P_MODE: tl.constexpr,
               STORE_PZ: tl.constexpr, P_TMA: tl.constexpr, REF_STATS: tl.constexpr, EVEN_N: tl.constexpr,
               ZERO_TARGET: tl.constexpr, FAST_EXP: tl.constexpr, TZ_FROM_REF: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(v_hi - v_lo, BN)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
            _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr, pid_m, pid_n, M,
                      v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p, logit_scale, softcap, inv_t,
                      HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY, HAS_SQ, HAS_MEAN, HAS_TOP1, COMPUTE, PRECISION, EVEN_K,
                      USE_TMA, BM, BN, BK, P_MODE, STORE_PZ, P_TMA, REF_STATS, EVEN_N, ZERO_TARGET, FAST_EXP,
                      TZ_FROM_REF)
    else:
        pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr, pid_m, pid_n, M,
                  v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p, logit_scale, softcap, inv_t,
                  HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY, HAS_SQ, HAS_MEAN, HAS_TOP1, COMPUTE, PRECISION, EVEN_K,
                  USE_TMA, BM, BN, BK, P_MODE, STORE_PZ, P_TMA, REF_STATS, EVEN_N, ZERO_TARGET, FAST_EXP,
                  TZ_FROM_REF)


@triton.jit
def _fwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, part_ptr, tlogit_ptr, p_ptr, pz_ptr, ref_ptr, pid_m, pid_n,
              M, v_lo, v_hi, K, stride_h, stride_w, part_stat_stride, stride_p,
              logit_scale, softcap, inv_t,
              HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
              HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
              COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P_MODE: tl.constexpr, STORE_PZ: tl.constexpr,
              P_TMA: tl.constexpr, REF_STATS: tl.constexpr, EVEN_N: tl.constexpr, ZERO_TARGET: tl.constexpr,
              FAST_EXP: tl.constexpr, TZ_FROM_REF: tl.constexpr):
    """One [BM, BN] block: its logits, reduced to per-row partial statistics in `part`; with P_MODE, also the
    block's e^(z − ref) (ref: a per-row reference, `ref_ptr`) stored at `p_ptr` for a cuBLAS GEMM to consume —
    P_MODE 1 (frozen head): times the softcap factor, target column 0, and e^(z − ref)·(z − ref) at `pz_ptr` when
    STORE_PZ; P_MODE 2 (materialised head): e^(z − ref) as is. With P_TMA, `p_ptr` / `pz_ptr` are tensor
    descriptors of this launch's [rows, chunk] views (bulk stores, clipped at their edges). With REF_STATS (only
    with P_MODE), the partial sums are taken against ref rather than the block's max (which is still stored).

    The epilogue is most of the kernel's time beside the GEMM, so it is kept lean: with EVEN_N (the launch's
    vocabulary chunk a multiple of BN: every column valid) no column masks; the target is found by one 32-bit compare
    of the block's column index with the row's target (a 64-bit compare of absolute indices cost some 20 instructions
    per element); and the frozen head's target column is zeroed in the block only with ZERO_TARGET, else by
    `merge_kernel` after the launch (a second use of the compare cost as much again). With TZ_FROM_REF (the
    sink's ref is the target's own logit, from `ref_logit_kernel`'s row-wise dot) the block does not look for the
    target at all: the host takes the target logit from ref."""
    z, t, offs_m, offs_n, row_ok, col_ok = _tile_logits(
        h_ptr, w_ptr, b_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h, stride_w, logit_scale, softcap, inv_t,
        HAS_BIAS, HAS_SOFTCAP, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK)
    if EVEN_N:
        zm = z
    else:
        zm = tl.where(col_ok[None, :], z, -float("inf"))
    if REF_STATS:
        ref = tl.load(ref_ptr + offs_m, mask=row_ok, other=0.0)
        e = _exp(zm - ref[:, None], FAST_EXP)  # e^(z − ref): no wait for the row max
        m = tl.max(zm, axis=1)
    else:
        m = tl.max(zm, axis=1)
        e = _exp(zm - m[:, None], FAST_EXP)
    base = part_ptr + pid_n * M + offs_m
    tl.store(base, m, mask=row_ok)
    tl.store(base + part_stat_stride, tl.sum(e, axis=1), mask=row_ok)
    z0 = z if EVEN_N else tl.where(col_ok[None, :], z, 0.0)
    if HAS_ENTROPY:
        tl.store(base + 2 * part_stat_stride, tl.sum(e * z0, axis=1), mask=row_ok)
    if HAS_SQ:
        tl.store(base + 3 * part_stat_stride, tl.sum(e * e, axis=1), mask=row_ok)
    if HAS_MEAN:
        tl.store(base + 4 * part_stat_stride, tl.sum(z0, axis=1), mask=row_ok)
    if HAS_TOP1 or not TZ_FROM_REF or ZERO_TARGET:
        tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1)
        # the target's column in this block (outside [0, BN) when it lies elsewhere; |tgt − blk_lo| < V: 32 bits)
        tcol = (tgt - (v_lo + pid_n * BN)).to(tl.int32)
        cols = tl.arange(0, BN)
        hit = cols[None, :] == tcol[:, None]
        if HAS_TOP1:
            before = cols[None, :] < tcol[:, None]
            tl.store(base + 5 * part_stat_stride, tl.max(tl.where(before, zm, -float("inf")), axis=1), mask=row_ok)
        if not TZ_FROM_REF:
            tz = tl.sum(tl.where(hit, z, 0.0), axis=1)
            mine = row_ok & (tcol >= 0) & (tcol < BN) & (tgt < v_hi)
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
            if ZERO_TARGET:
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
def bwd_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr,
               M, v_lo, v_hi, K, stride_h, stride_w, stride_dz,
               logit_scale, softcap, inv_t,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_GE: tl.constexpr,
               COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               PERSISTENT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, DZ_TMA: tl.constexpr, FAST_EXP: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(v_hi - v_lo, BN)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_pid(tile, num_pid_m, num_pid_n, GROUP_M)
            _bwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr, pid_m, pid_n, M, v_lo,
                      v_hi, K, stride_h, stride_w, stride_dz, logit_scale, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP,
                      HAS_G, HAS_GE, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK, DZ_TMA, FAST_EXP)
    else:
        pid_m, pid_n = _grouped_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _bwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr, pid_m, pid_n, M, v_lo,
                  v_hi, K, stride_h, stride_w, stride_dz, logit_scale, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP,
                  HAS_G, HAS_GE, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK, DZ_TMA, FAST_EXP)


@triton.jit
def _bwd_tile(h_ptr, w_ptr, b_ptr, tgt_ptr, logz_ptr, ent_ptr, g_ptr, ge_ptr, dz_ptr, pid_m, pid_n,
              M, v_lo, v_hi, K, stride_h, stride_w, stride_dz,
              logit_scale, softcap, inv_t,
              HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_GE: tl.constexpr,
              COMPUTE: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DZ_TMA: tl.constexpr, FAST_EXP: tl.constexpr):
    """One [BM, BN] block of dZ: the logits recomputed, turned into their gradient, stored in the compute dtype."""
    z, t, offs_m, offs_n, row_ok, col_ok = _tile_logits(
        h_ptr, w_ptr, b_ptr, pid_m, pid_n, M, v_lo, v_hi, K, stride_h, stride_w, logit_scale, softcap, inv_t,
        HAS_BIAS, HAS_SOFTCAP, COMPUTE, PRECISION, EVEN_K, USE_TMA, BM, BN, BK)
    log_z = tl.load(logz_ptr + offs_m, mask=row_ok, other=0.0)
    log_p = z - log_z[:, None]
    p = _exp(log_p, FAST_EXP)
    scale = inv_t * logit_scale  # folded into the per-row factors: two multiplies per element fewer
    grad = tl.zeros((BM, BN), dtype=tl.float32)
    if HAS_G:
        g = tl.load(g_ptr + offs_m, mask=row_ok, other=0.0) * scale
        tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1)
        tcol = (tgt - (v_lo + pid_n * BN)).to(tl.int32)  # a 32-bit compare of block columns, as `_fwd_tile`'s
        hit = (tl.arange(0, BN)[None, :] == tcol[:, None]).to(tl.float32)
        grad += g[:, None] * (hit - p)
    if HAS_GE:
        ge = tl.load(ge_ptr + offs_m, mask=row_ok, other=0.0) * scale
        ent = tl.load(ent_ptr + offs_m, mask=row_ok, other=0.0)
        grad -= ge[:, None] * p * (log_p + ent[:, None])
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    if DZ_TMA:  # dz_ptr is a descriptor of this [rows, chunk] tile: rows / columns past its edge are not written
        dz_ptr.store([pid_m * BM, pid_n * BN], grad.to(dz_ptr.dtype))
    else:
        ptrs = dz_ptr + offs_m.to(tl.int64)[:, None] * stride_dz + (offs_n - v_lo)[None, :]
        tl.store(ptrs, grad.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def dz_from_p_kernel(p_ptr, tgt_ptr, shift_ptr, lp_ptr, ent_ptr, g_ptr, ge_ptr, M, V, stride_p, scale,
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
def frozen_dx_kernel(acc_ptr, w_ptr, y_ptr, g_ptr, ge_ptr, lp_ptr, omp_ptr, ent_ptr, tlogit_ptr, out_ptr, M, K,
                     acc_plane, stride_w, stride_out, scale, inv_cap,
                     HAS_G: tl.constexpr, HAS_GE: tl.constexpr, HAS_B: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                     COMPUTE: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """The frozen head's input gradient in one pass: out = coef_y·W_y + coef_a·A (+ coef_b·B), per row, with the
    coefficients formed here from g, h (the entropy's upstream gradient), the log-prob, 1 − p_y (`omp`, from expm1),
    the entropy and the target's softcap factor (the math: `grpo_lab.loss.frozen.frozen_coefficients` and
    `frozen_input_grad`); W_y gathered by target and read as the projection saw it."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    r_ok = offs_r < M
    ok = r_ok[:, None] & (offs_h < K)[None, :]
    rows = offs_r.to(tl.int64)[:, None]
    coef_y = tl.zeros((BR,), dtype=tl.float32)
    coef_a = tl.zeros((BR,), dtype=tl.float32)
    if HAS_G:
        g = tl.load(g_ptr + offs_r, mask=r_ok, other=0.0)
        coef_y += tl.load(omp_ptr + offs_r, mask=r_ok, other=0.0) * g
        coef_a -= g
    if HAS_GE:
        h = tl.load(ge_ptr + offs_r, mask=r_ok, other=0.0)
        lp = tl.load(lp_ptr + offs_r, mask=r_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_r, mask=r_ok, other=0.0)
        coef_y -= h * tl.exp(lp) * (lp + ent)
        coef_a -= h * ent
    if HAS_SOFTCAP:
        t_y = tl.load(tlogit_ptr + offs_r, mask=r_ok, other=0.0) * inv_cap
        coef_y *= 1.0 - t_y * t_y
    y = tl.load(y_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
    w_y = tl.load(w_ptr + y[:, None] * stride_w + offs_h[None, :], mask=ok, other=0.0).to(COMPUTE).to(tl.float32)
    a = tl.load(acc_ptr + rows * K + offs_h[None, :], mask=ok, other=0.0)
    out = (coef_y * scale)[:, None] * w_y + (coef_a * scale)[:, None] * a
    if HAS_B:
        if HAS_GE:
            b = tl.load(acc_ptr + acc_plane + rows * K + offs_h[None, :], mask=ok, other=0.0)
            out -= (h * scale)[:, None] * b
    tl.store(out_ptr + rows * stride_out + offs_h[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def frozen_finish_kernel(acc_ptr, m_ptr, s_ptr, ref_ptr, bad_ptr, count_ptr, M, K, acc_plane, limit, excess,
                         HAS_B: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """The end of the frozen forward, one pass over A (and B): rebases them from ref to log Z in place
    (A ← f·A, B ← f·(B − (log Z − ref)·A), f = e^(ref − log Z)), flags the rows to recompute against their max
    (the max over `limit` above ref, a non-finite accumulator, or with B, p_max·(max − ref) over `excess`) in `bad`
    and adds their count to `count`: the check and the rebase of `launch` in one launch instead of some fifteen."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = offs_r < M
    run_m = tl.load(m_ptr + offs_r, mask=r_ok, other=0.0)
    run_s = tl.load(s_ptr + offs_r, mask=r_ok, other=1.0)
    gap = run_m - tl.load(ref_ptr + offs_r, mask=r_ok, other=0.0)
    log_sum = gap + tl.log(run_s)
    f = tl.exp(-log_sum)
    rows = offs_r.to(tl.int64)[:, None]
    nonfinite = tl.zeros((BR,), dtype=tl.int32)
    for h0 in range(0, K, BH):
        offs_h = h0 + tl.arange(0, BH)
        ok = r_ok[:, None] & (offs_h < K)[None, :]
        at = acc_ptr + rows * K + offs_h[None, :]
        a = tl.load(at, mask=ok, other=0.0)
        bad_el = (a != a) | (tl.abs(a) == float("inf"))
        if HAS_B:
            b = tl.load(at + acc_plane, mask=ok, other=0.0)
            bad_el = bad_el | (b != b) | (tl.abs(b) == float("inf"))
            tl.store(at + acc_plane, f[:, None] * (b - log_sum[:, None] * a), mask=ok)
        tl.store(at, f[:, None] * a, mask=ok)
        nonfinite += tl.sum(bad_el.to(tl.int32), axis=1)
    bad = (nonfinite > 0) | (tl.where(gap <= limit, 0, 1) > 0)  # a NaN gap is never <= limit
    if HAS_B:
        bad = bad | (gap / run_s > excess)
    bad = bad & r_ok
    tl.store(bad_ptr + offs_r, bad.to(tl.int8), mask=r_ok)
    tl.atomic_add(count_ptr, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit
def ref_logit_kernel(h_ptr, w_ptr, b_ptr, y_ptr, out_ptr, M, K, stride_h, stride_w, logit_scale, softcap, inv_t,
                     HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE: tl.constexpr, BR: tl.constexpr,
                     BH: tl.constexpr):
    """Each row's target logit (a row-wise dot in fp32 of operands rounded as the projection sees them, then bias,
    scale, softcap and temperature as `_tile_logits`): the per-row reference the frozen and materialised forwards
    store e^(z − ref) against, in one launch."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = offs_r < M
    rows = offs_r.to(tl.int64)[:, None]
    y = tl.load(y_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
    z = tl.zeros((BR,), dtype=tl.float32)
    for h0 in range(0, K, BH):
        offs_h = h0 + tl.arange(0, BH)
        ok = r_ok[:, None] & (offs_h < K)[None, :]
        x = tl.load(h_ptr + rows * stride_h + offs_h[None, :], mask=ok, other=0.0).to(COMPUTE).to(tl.float32)
        w = tl.load(w_ptr + y[:, None] * stride_w + offs_h[None, :], mask=ok, other=0.0).to(COMPUTE).to(tl.float32)
        z += tl.sum(x * w, axis=1)
    if HAS_BIAS:
        z += tl.load(b_ptr + y, mask=r_ok, other=0.0).to(COMPUTE).to(tl.float32)
    if HAS_SOFTCAP:
        z = z * logit_scale
        z = softcap * (2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0) * inv_t
    else:
        z = z * (logit_scale * inv_t)
    tl.store(out_ptr + offs_r, z, mask=r_ok)


@triton.jit
def merge_kernel(part_ptr, run_ptr, p_ptr, pz_ptr, tgt_ptr, part_stat_stride, run_stat_stride, M, n_blocks, v_lo,
                 v_hi, stride_p,
                 HAS_ENTROPY: tl.constexpr, HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
                 BR: tl.constexpr, BV: tl.constexpr, REF_STATS: tl.constexpr, ZERO_P: tl.constexpr):
    """Folds one launch's per-block partial statistics (`part`, [stat, block, row]) into the running ones (`run`,
    [stat, row]) in place: the online-LSE merge, one launch instead of a dozen torch ops per vocabulary chunk. With
    REF_STATS every sum is against the same per-row ref, so they add as they are (the max is still merged).

    ZERO_P (1: P~, 2: P~ and P~·(z − ref)): also zeroes the frozen head's target column in the launch's P~ block for
    the rows whose target lies in its vocabulary chunk [v_lo, v_hi): one store per row here, between the forward
    launch and the GEMM that reads the block, instead of a compare and select per element in `fwd_kernel`'s
    epilogue or a launch of its own."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = offs_r < M
    if ZERO_P != 0:
        tgt = tl.load(tgt_ptr + offs_r, mask=r_ok, other=-1)
        hit = r_ok & (tgt >= v_lo) & (tgt < v_hi)
        at_tgt = offs_r.to(tl.int64) * stride_p + (tgt - v_lo)
        tl.store(p_ptr + at_tgt, tl.zeros((BR,), dtype=p_ptr.dtype.element_ty), mask=hit)
        if ZERO_P == 2:
            tl.store(pz_ptr + at_tgt, tl.zeros((BR,), dtype=pz_ptr.dtype.element_ty), mask=hit)
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
def mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
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


@triton.jit
def nt_mm_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_c,
                 ACC: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """fp32 C[M, N] (+)= A[M, K] @ B[N, K]ᵀ from two K-major tensor descriptors: the only operand layout Hopper's
    tensor cores take TF32 in, so the split-TF32 (`tf32x3`) dX / dW of the fp32 path run at tensor-core speed
    (`split_tf32`). The copy engine zero-fills the tails past M, N and K."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = a_desc.load([pid_m * BM, k * BK])
        b = b_desc.load([pid_n * BN, k * BK])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    c_ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if ACC:
        acc += tl.load(c_ptrs, mask=c_ok, other=0.0)
    tl.store(c_ptrs, acc, mask=c_ok)
