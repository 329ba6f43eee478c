"""The host side of the Triton kernel: which path a call takes, the buffers ("sinks") the forward stores into, and
the forward and backward launch sequences.

Forward. The statistics of the valid rows are built one `[token tile, vocabulary chunk]` launch at a time
(`fwd_kernel`, then `merge_kernel`), so memory is flat in N; a sink receives what the launch stored besides: the
frozen head's P~ blocks (consumed at once by a cuBLAS GEMM into A = Σ p·W), a materialised head's whole [rows, V]
e^(z − ref), or nothing. Rows whose stored exponentials could overflow are recomputed against their exact max.

Backward. Vocabulary-outer, so the weight gradient of a vocabulary chunk is finished before the next one starts: it
goes straight into the weight-dtype gradient (one GEMM when all tokens fit one tile, else a chunk-sized fp32 buffer),
so no full-size fp32 copy of the weight gradient ever exists (TRL keeps one). cuBLAS does `dX += dZ @ W` (fp32
accumulator) and `dW = dZᵀ @ X`; the frozen head's backward is one elementwise pass (`frozen.frozen_input_grad`).

Every tile size and switch is read from `tuning.TUNING` at call time.
"""

from __future__ import annotations

import functools
import inspect

import torch

import triton
import triton.language as tl

from ..contract import scatter_grad
from .descriptors import tma_target
from .policy import SPARE_BYTES, free_device_bytes, materialize_decision, record_path, room_below_peak
from .relaunch import Relauncher, arg_spec, int_spec
from .split_tf32 import SplitTF32Gradients
from .triton_kernels import (bwd_kernel, dz_from_p_kernel, frozen_dx_kernel, frozen_finish_kernel, fwd_kernel,
                             merge_kernel, ref_logit_kernel)
from .tuning import TUNING

TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# Persistent launches need a Triton whose `tl.range` has `flatten` (3.3+); older ones get one program per tile.
_FLATTEN_OK = "flatten" in inspect.signature(tl.range).parameters
# The last launch of each fused kernel, as Triton compiled it (registers per thread, spills, shared memory): read by
# benchmarks/loss_bench.py --tune to say how many programs an SM can hold.
LAST_COMPILED = {}


def dtype_key(compute: torch.dtype) -> str:
    return "32" if compute == torch.float32 else "16"


def _config(kind: str, compute: torch.dtype):
    return TUNING.configs[f"{kind}_{dtype_key(compute)}"]


def _precision(compute: torch.dtype) -> str:
    return TUNING.fp32_dot if compute == torch.float32 else "ieee"


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
    ok = (TUNING.use_tma and h.dtype == compute and weight.dtype == compute and h.stride(1) == 1
          and weight.stride(1) == 1 and (h.stride(0) * h.element_size()) % 16 == 0 and (weight.stride(0) * weight.element_size()) % 16 == 0
          and h.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)
    if not ok:
        return h, weight, False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton without host-side tensor descriptors: the pointer path
        return h, weight, False

    return TensorDescriptor.from_tensor(h, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]), True


def _programs(kind: str, compute: torch.dtype, n_tiles: int, device: torch.device) -> tuple[int, bool]:
    """(grid size, persistent): `programs_per_sm` programs per SM looping over the tiles, or one program per tile.
    The frozen forward follows the statistics forward's `persistent` switch."""
    key = f"{kind}_{dtype_key(compute)}"
    if not (TUNING.persistent[key.replace("frozen", "fwd")] and _FLATTEN_OK):
        return n_tiles, False
    slots = TUNING.persistent_programs
    if slots is None:
        slots = _sm_count(device) * TUNING.programs_per_sm[key]
    return min(n_tiles, slots), True


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (3 off CUDA: Triton's interpreter, where the count only shapes loops)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3


def _dz_target(tile: torch.Tensor, bm: int, bn: int, tma_loads: bool):
    """(dz arg, use_tma): a tensor descriptor of the dZ tile when `dz_tma` is on and its layout allows it."""
    return tma_target(tile, bm, bn, TUNING.dz_tma[dtype_key(tile.dtype)] and tma_loads)


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
    ref_is_target = True

    def __init__(self, m_rows, weight, compute, ref, with_plogp, bn, ref_stats=True):
        self.ref_stats = ref_stats  # statistics against ref (when `ref_stats` allows), or against each block's max
        tokens, vocab_tile = TUNING.frozen_tile[dtype_key(compute)]
        self.t_tile = min(m_rows, tokens)
        self.v_tile = _widened_vocab_tile(weight.shape[0], tokens, vocab_tile, self.t_tile, bn)
        depth = 2 if with_plogp else 1
        self.buf = torch.empty((depth, self.t_tile, self.v_tile), device=ref.device, dtype=compute)
        self.acc = torch.zeros((depth, m_rows, weight.shape[1]), device=ref.device, dtype=torch.float32)
        self.weight, self.compute, self.ref = weight, compute, ref
        self._planes = {}  # (rows, chunk, bm, bn, tma loads) -> (p, pz, through): the buffer is reused chunk after chunk

    def views(self, t0, t1, v0, v1, bm, bn, tma_loads):
        """(p, pz, ref rows, row stride, store pz, through descriptors) for the launch on rows t0:t1 and vocabulary
        v0:v1: the buffer's planes, or descriptors of their [rows, chunk] views (`p_tma`). Made once per shape: every
        full chunk writes the same views of the same buffer, and on a small head the host's time per chunk is what
        the GPU waits for (issue 45, `step_timeline.py --host-profile`)."""
        key = (t1 - t0, v1 - v0, bm, bn, tma_loads)
        if key not in self._planes:
            self._planes[key] = self._make_planes(*key)
        p, pz, through = self._planes[key]
        return p, pz, self.ref[t0:t1], self.buf.stride(1), self.buf.shape[0] == 2, through

    def _make_planes(self, rows, chunk, bm, bn, tma_loads):
        p, pz = self.buf[0], self.buf[-1]
        if TUNING.p_tma[dtype_key(self.compute)] and tma_loads:
            dp, tma_p = tma_target(p[:rows, :chunk], bm, bn, True)
            dpz, tma_pz = (dp, tma_p) if self.buf.shape[0] == 1 else tma_target(pz[:rows, :chunk], bm, bn, True)
            if tma_p and tma_pz:
                return dp, dpz, True
        return p, pz, False

    def zero_target_args(self):
        """(P~, P~·(z − ref), row stride, ZERO_P) for `merge_kernel` to zero the target column of a block it merges
        (`target_zero_pass`)."""
        return self.buf[0], self.buf[-1], self.buf.stride(1), self.buf.shape[0] if TUNING.target_zero_pass else 0

    def consume(self, t0, t1, v0, v1):
        w_c = self.weight[v0:v1].to(self.compute)
        for i in range(self.buf.shape[0]):
            _mm_acc(self.acc[i, t0:t1], self.buf[i, : t1 - t0, : v1 - v0], w_c)


class _RefSink:
    """No stores: only the per-row ref the statistics are taken against (`ref_stats_plain`). All rows per launch;
    the vocabulary chunk follows the statistics budget (so also for `_MaterializedSink`)."""

    p_mode = 0
    ref_is_target = True
    t_tile = None
    v_tile = None

    def __init__(self, ref):
        self.ref = ref

    def views(self, t0, t1, v0, v1, bm, bn, tma_loads):
        return self.ref, self.ref, self.ref[t0:t1], 0, False, False

    def consume(self, t0, t1, v0, v1):
        pass


class _TargetLogitSink(_RefSink):
    """The statistics-only forward's ref as the target logit alone: the statistics stay against each block's max
    (nothing can overflow, no rows to check, no host sync), and the blocks need not look for the target."""

    ref_stats = False


class _MaterializedSink(_RefSink):
    """Trainable head with memory allowed for speed: e^(z − ref) of every row and vocabulary entry is kept
    (`full`, [rows, V] in the compute dtype), so the backward is an elementwise pass and two GEMMs, no recompute."""

    p_mode = 2

    def __init__(self, full, ref, ref_stats=True):
        super().__init__(ref)
        self.full = full
        self.ref_stats = ref_stats  # statistics against ref (when `ref_stats` allows), or against each block's max

    def views(self, t0, t1, v0, v1, bm, bn, tma_loads):
        view = self.full[t0:t1, v0:]
        if TUNING.p_tma[dtype_key(self.full.dtype)] and tma_loads:  # bulk stores of this launch's [rows, chunk]
            desc, through = tma_target(self.full[t0:t1, v0:v1], bm, bn, True)
            if through:  # (a [BM, BN] int64 pointer tile per block spilled 608 B of registers on sm_90a)
                return desc, desc, self.ref[t0:t1], self.full.stride(0), False, True
        return view, view, self.ref[t0:t1], self.full.stride(0), False, False


def _target_logit_from_ref(want: dict) -> bool:
    """Whether a forward whose ref is the target's logit takes the target logit from it (`target_logit_from_ref`):
    not when is_top1 is asked for, which compares the target logit with the row max and so needs the blocks' own."""
    return TUNING.target_logit_from_ref and not want["is_top1"]


def _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, sink=None):
    """Running online-LSE statistics of the valid rows `h` over the whole vocabulary (and, with a sink, its P~
    blocks handed over launch by launch)."""
    m_rows, k = h.shape
    vocab = weight.shape[0]
    dev = h.device
    kind = "frozen" if sink is not None and sink.p_mode == 1 else "fwd"  # the frozen head's also stores P~
    bm, bn, bk, group_m, warps, stages = _config(kind, compute)
    t_tile = (sink.t_tile if sink is not None else None) or m_rows
    v_tile = (sink.v_tile if sink is not None else None) or bn * max(
        1, min(triton.cdiv(vocab, bn), TUNING.part_budget_bytes // (t_tile * 4 * 6)))
    part = torch.empty((6, triton.cdiv(min(v_tile, vocab), bn) * t_tile), device=dev, dtype=torch.float32)
    run = torch.zeros((6, m_rows), device=dev)  # max, Σexp, Σexp·z, Σexp², Σz, max before the target
    run[0].fill_(float("-inf"))
    run[5].fill_(float("-inf"))
    # a sink's ref is the target's own logit (a row-wise dot) unless `_redo_rows` set it to the row max
    tz_from_ref = sink is not None and sink.ref_is_target and _target_logit_from_ref(want)
    target_logit = sink.ref.clone() if tz_from_ref else torch.zeros(m_rows, device=dev)
    flags = dict(HAS_ENTROPY=want["entropy"], HAS_SQ=want["log_sum_sq_probs"], HAS_MEAN=want["mean_logits"],
                 HAS_TOP1=want["is_top1"])
    ref_stats = sink is not None and getattr(sink, "ref_stats", True) and (
        sink.p_mode == 0 or TUNING.ref_stats[dtype_key(compute)])
    fixed = dict(b_ptr=bias if bias is not None else h, part_ptr=part, K=k, stride_h=h.stride(0),
                 stride_w=weight.stride(0), part_stat_stride=part.stride(0), logit_scale=float(logit_scale),
                 softcap=float(softcap or 1.0), inv_t=float(inv_t), HAS_BIAS=bias is not None,
                 HAS_SOFTCAP=softcap is not None, **flags, COMPUTE=TL_DTYPE[compute], PRECISION=_precision(compute),
                 EVEN_K=k % bk == 0, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                 P_MODE=sink.p_mode if sink is not None else 0, REF_STATS=ref_stats,
                 ZERO_TARGET=kind == "frozen" and not TUNING.target_zero_pass, FAST_EXP=h.is_cuda and TUNING.fast_exp,
                 TZ_FROM_REF=tz_from_ref)
    options = dict(num_warps=warps, num_stages=stages, **TUNING.launch_options[f"{kind}_{dtype_key(compute)}"])
    zp, zpz, zstride, zero_p = sink.zero_target_args() if kind == "frozen" else (part, part, 0, 0)
    merge_fixed = dict(part_ptr=part, p_ptr=zp, pz_ptr=zpz, part_stat_stride=part.stride(0),
                       run_stat_stride=run.stride(0), stride_p=zstride, **flags, BR=TUNING.merge_rows,
                       BV=TUNING.merge_blocks, REF_STATS=ref_stats, ZERO_P=zero_p)
    for t0 in range(0, m_rows, t_tile):
        t1 = min(m_rows, t0 + t_tile)
        rows = t1 - t0
        h_arg, w_arg, tma = _operands(h[t0:t1], weight, compute, bm, bn, bk)
        run_t, y_t, tlogit_t = run[:, t0:t1], y[t0:t1], target_logit[t0:t1]
        fwd, merge = Relauncher(fwd_kernel), Relauncher(merge_kernel)  # the chunks of this token tile
        for v0 in range(0, vocab, v_tile):
            v1 = min(vocab, v0 + v_tile)
            nvb = triton.cdiv(v1 - v0, bn)
            n_progs, persistent = _programs(kind, compute, triton.cdiv(rows, bm) * nvb, dev)
            p, pz, ref, stride_p, store_pz, p_tma = sink.views(t0, t1, v0, v1, bm, bn, tma) if sink else (
                part, part, part, 0, False, False)
            even_n = (v1 - v0) % bn == 0
            key = lambda: (int_spec(v0), int_spec(v1), n_progs, arg_spec(p), arg_spec(pz), even_n,  # noqa: E731
                           store_pz, p_tma)
            compiled = fwd((n_progs,), key, dict(
                h_ptr=h_arg, w_ptr=w_arg, tgt_ptr=y_t, tlogit_ptr=tlogit_t, p_ptr=p, pz_ptr=pz, ref_ptr=ref, M=rows,
                v_lo=v0, v_hi=v1, stride_p=stride_p, USE_TMA=tma, PERSISTENT=persistent, NUM_PROGRAMS=n_progs,
                STORE_PZ=store_pz, P_TMA=p_tma, EVEN_N=even_n, **fixed), options)
            LAST_COMPILED[f"{kind}_{dtype_key(compute)}"] = compiled
            merge((triton.cdiv(rows, TUNING.merge_rows),), lambda: (int_spec(nvb), int_spec(v0), int_spec(v1)), dict(
                run_ptr=run_t, tgt_ptr=y_t, M=rows, n_blocks=nvb, v_lo=v0, v_hi=v1, **merge_fixed), {"num_warps": 4})
            if sink is not None:
                sink.consume(t0, t1, v0, v1)
    if ref_stats:  # the sums against ref → against the row max, as the rest of the kernel expects
        to_max = torch.exp(sink.ref - run[0])
        run[1:3].mul_(to_max)
        run[3].mul_(to_max * to_max)
    return (run[0], run[1], run[2] if want["entropy"] else None, run[3] if want["log_sum_sq_probs"] else None,
            run[4] if want["mean_logits"] else None, run[5] if want["is_top1"] else None, target_logit)


def _reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale):
    """Each row's target logit, cheaply (one row-wise dot per row, `ref_logit_kernel`): the reference e^(z − ref) is
    taken against. Any value ≤ the row's max does (no overflow unless the max is `ref_headroom` above it, and such
    rows are recomputed against their exact max); the target's own logit is close to the max for sampled tokens."""
    out = torch.empty(h.shape[0], device=h.device)
    br, bh = 16, 256
    ref_logit_kernel[(triton.cdiv(h.shape[0], br),)](
        h, weight, bias if bias is not None else h, y, out, h.shape[0], h.shape[1], h.stride(0), weight.stride(0),
        float(logit_scale), float(softcap or 1.0), float(inv_t), HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None, COMPUTE=TL_DTYPE[compute], BR=br, BH=bh, num_warps=4)
    return out


def frozen_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, with_plogp):
    """Statistics + A (+ B) of the frozen head, relative to log Z (see `frozen.frozen_input_grad`), and the pending
    check of its rows (`PendingRescue`; None when the check already ran here).

    With `frozen_deferred_check` the forward never waits for the GPU: its statistics are taken against each block's
    max (exact whatever the ref), so only A and B of an overflowing row can be wrong, and which rows those are is
    read back asynchronously and repaired by the backward (`PendingRescue.resolve`). Otherwise the rows are checked
    here, one host sync, with the statistics against ref (`ref_stats`)."""
    bn = _config("frozen", compute)[1]
    deferred = TUNING.frozen_deferred_check[dtype_key(compute)]
    ref = _reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale)
    sink = _FrozenSink(h.shape[0], weight, compute, ref, with_plogp, bn, ref_stats=not deferred)
    stats = _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, sink)
    acc = sink.acc
    bad = torch.empty(h.shape[0], device=h.device, dtype=torch.int8)
    count = torch.zeros(1, device=h.device, dtype=torch.int32)
    br, bh = 16, 256
    frozen_finish_kernel[(triton.cdiv(h.shape[0], br),)](
        acc, stats[0], stats[1], ref, bad, count, h.shape[0], h.shape[1], acc.stride(0),
        float(_ref_limit(compute, want, against_ref=False if deferred else None)),
        float(TUNING.plogp_excess[dtype_key(compute)]), HAS_B=acc.shape[0] == 2, BR=br, BH=bh, num_warps=4)

    def repair(rows, valid_h):  # the flagged rows' A (and B) against their exact max
        redo = _redo_rows(rows, stats, ref, lambda r: _FrozenSink(rows.numel(), weight, compute, r, with_plogp, bn),
                          valid_h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
        acc.index_copy_(1, rows, _rebase_to_log_z(redo.acc, stats[0][rows], stats[1][rows], ref[rows]))

    pending = PendingRescue(bad, count, repair)
    if deferred:
        return stats, acc, pending
    pending.resolve(lambda: h)  # here: with the statistics against ref, a flagged row's statistics are redone
    return stats, acc, None


class PendingRescue:
    """A forward's overflow check (frozen and materialised heads), read back without stalling the host.

    The forward queues the count of rows to recompute into pinned host memory and records an event behind it; the
    backward waits for that event only (by then the GPU is usually far past it, so the host does not drain the queue
    of the loss's work as a sync in the forward would) and, in the rare case of a nonzero count, has `repair(rows,
    valid hidden states)` recompute what the backward needs of those rows against their exact max, as the forward
    would have. It keeps no copy of the hidden states: the backward hands them over (`valid_hidden`) only when there
    are rows to redo."""

    def __init__(self, bad, count, repair):
        self.bad, self.repair = bad, repair
        self.event = None
        self.count = count
        if count.is_cuda:
            self.count = torch.empty(1, dtype=count.dtype, pin_memory=True)
            self.count.copy_(count, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def resolve(self, valid_hidden) -> int:
        """Repairs the rows the check flagged; returns how many there were. `valid_hidden()` gives the hidden states
        of the valid rows, as the forward saw them."""
        if self.event is not None:
            self.event.synchronize()
        if int(self.count) == 0:
            return 0
        rows = self.bad.nonzero().squeeze(-1)
        self.repair(rows, valid_hidden())
        return rows.numel()


def statistics_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want):
    """The statistics-only forward; with `ref_stats_plain` against each row's target logit, rows too far below their
    max recomputed against it. Without, the target logit still comes from the row-wise dot where
    `target_logit_from_ref` allows (`_TargetLogitSink`)."""
    if not TUNING.ref_stats_plain[dtype_key(compute)]:
        sink = None
        if _target_logit_from_ref(want):
            sink = _TargetLogitSink(_reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale))
        return _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want, sink)
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
    sink.ref_is_target = False  # against the max now: the blocks find the target logit themselves
    redone = _forward_stats(h[rows], weight, bias, y[rows], inv_t, softcap, logit_scale, compute, want, sink)
    for kept, new in zip(stats, redone):
        if kept is not None:
            kept.index_copy_(0, rows, new)
    return sink


def _ref_limit(compute: torch.dtype, want: dict, against_ref: bool | None = None) -> float:
    """How far a row's max may sit above its ref before the row is recomputed against its max (`against_ref`: the
    statistics were taken against ref; `ref_stats` by default)."""
    if against_ref is None:
        against_ref = TUNING.ref_stats[dtype_key(compute)]
    if against_ref and want["log_sum_sq_probs"]:
        return min(TUNING.ref_headroom, TUNING.sq_ref_headroom)
    return TUNING.ref_headroom


def _rows_to_recompute(run_m, run_s, ref, acc, compute, limit=None):
    """Indices of `_bad_rows`. One host sync. (`_bad_rows` and `_rebase_to_log_z` state in torch what
    `frozen_finish_kernel` does in one pass; the CPU tests check the rule on them and the kernel against them.)"""
    return _bad_rows(run_m, run_s, ref, acc, compute, limit).nonzero().squeeze(-1)


def _bad_rows(run_m, run_s, ref, acc, compute, limit=None):
    """Mask of the rows whose P~ was stored too far below their max (overflow risk: `limit`, `ref_headroom` by
    default; with B, its rounding: `plogp_excess`, where p_max = 1 / run_s) or whose accumulators are not finite."""
    limit = TUNING.ref_headroom if limit is None else limit
    gap = run_m - ref
    bad = _far_below_max(run_m, ref, limit) | ~torch.isfinite(acc.sum(-1)).all(0)  # an inf / nan row sums to one
    if acc.shape[0] == 2:
        bad |= gap / run_s > TUNING.plogp_excess[dtype_key(compute)]
    return bad


def _rebase_to_log_z(acc, run_m, run_s, ref):
    """A_rel = Σ P~·W and B_rel = Σ P~·(z − ref)·W (against ref) → A = Σ p·W and B = Σ p·log p·W, in place."""
    log_sum = run_m - ref + torch.log(run_s)  # log Z − ref
    if acc.shape[0] == 2:  # B = f·(B_rel − (log Z − ref)·A_rel)
        acc[1].addcmul_(acc[0], -log_sum.unsqueeze(-1))
    acc.mul_(torch.exp(-log_sum).view(1, -1, 1))
    return acc


def materialized_forward(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want):
    """Statistics + the kept [rows, V] e^(z − ref) of a materialised head, ref − log Z per row, and the pending check
    of its rows (`PendingRescue`; None when the check already ran here).

    With `materialized_deferred_check` the forward never waits for the GPU, as the frozen head's: statistics against
    each block's max (exact whatever the ref), so only the kept row of an overflowing row can be wrong; the backward
    reads back which rows those are and recomputes them (and their ref − log Z) against their max. Otherwise one host
    sync here, with the statistics against ref (`ref_stats`)."""
    deferred = TUNING.materialized_deferred_check[dtype_key(compute)]
    ref = _reference_logits(h, weight, bias, y, compute, inv_t, softcap, logit_scale)
    full = torch.empty((h.shape[0], weight.shape[0]), device=h.device, dtype=compute)
    stats = _forward_stats(h, weight, bias, y, inv_t, softcap, logit_scale, compute, want,
                           _MaterializedSink(full, ref, ref_stats=not deferred))
    run_m, run_s = stats[0], stats[1]
    shift = ref - (run_m + torch.log(run_s))
    bad = _far_below_max(run_m, ref, _ref_limit(compute, want, against_ref=False if deferred else None))

    def repair(rows, valid_h):  # the flagged rows' kept probabilities against their exact max
        redo = _redo_rows(rows, stats, ref, lambda r: _MaterializedSink(
            torch.empty((rows.numel(), weight.shape[0]), device=h.device, dtype=compute), r),
            valid_h, weight, bias, y, inv_t, softcap, logit_scale, compute, want)
        full.index_copy_(0, rows, redo.full)
        shift.index_copy_(0, rows, ref[rows] - (run_m[rows] + torch.log(run_s[rows])))

    pending = PendingRescue(bad, bad.sum(dtype=torch.int32).reshape(1), repair)
    if deferred:
        return stats, full, shift, pending
    pending.resolve(lambda: h)
    return stats, full, shift, None


def materialize_fits(n_rows: int, vocab: int, hidden: int, weight_bytes: int, compute: torch.dtype,
                     device: torch.device) -> bool:
    """Whether a trainable head keeps its [rows, V] probabilities: the memory policy (`policy.materialize_decision`)
    on the bytes that needs, the bytes free on the device now and, with `materialize_within_peak`, the room under
    the run's peak for the buffer and what the backward holds beside it (dX in fp32, X scaled per row, dW:
    `weight_bytes`)."""
    if not materialize_policy_on():
        return False  # no need to ask the driver
    size = torch.empty((), dtype=compute).element_size()
    need = n_rows * vocab * size
    backward = n_rows * hidden * (4 + size) + weight_bytes  # dX in fp32, X scaled per row, dW
    allowance = None if TUNING.materialize_gib is None else TUNING.materialize_gib * 2**30
    cuda = device.type == "cuda"
    # off CUDA (Triton's interpreter on a CPU) as if just the buffer and the spare were free, under a peak of room
    free = free_device_bytes(device) if cuda else need + SPARE_BYTES
    room = None
    if TUNING.materialize_within_peak and allowance is None:
        room = room_below_peak(device) if cuda else need + backward
    return materialize_decision(need, free, TUNING.materialize_fraction, allowance, room_below_peak=room,
                                backward_bytes=backward)


def materialize_policy_on() -> bool:
    """Whether the policy may keep a buffer at all (fraction > 0 without an allowance, or an allowance > 0)."""
    if TUNING.materialize_gib is not None:
        return TUNING.materialize_gib > 0
    return TUNING.materialize_fraction > 0


def _trainable_path(compute: torch.dtype, softcap, n_valid: int, vocab: int, device, hidden: int,
                    weight_bytes: int) -> tuple[str, bool]:
    """(path, flat for memory) of a trainable head: `materialized` where the memory policy keeps the buffer, else
    `recompute`; the flag says the policy wanted the buffer and the free memory was short."""
    if softcap is not None or compute == torch.float16 or not materialize_policy_on():
        return "recompute", False
    if TUNING.materialize_gib is None and n_valid * hidden < TUNING.materialize_flat_below[dtype_key(compute)]:
        return "recompute", False  # a small head is host-bound: the flat path is as fast or faster there
    if materialize_fits(n_valid, vocab, hidden, weight_bytes, compute, device):
        return "materialized", False
    return "recompute", True


def choose_path(mode: str, compute: torch.dtype, softcap, n_valid: int, vocab: int, device, hidden: int,
                weight_bytes: int = 0) -> str:
    """`stats` (no gradient), `frozen` (two GEMMs), `materialized` (three, the buffer fits the memory policy) or
    `recompute` (four; three for a frozen head, which needs no weight gradient). `weight_bytes`: the weight's size,
    which its gradient will take beside the buffer. Counted in `policy.path_counts()`."""
    flat_for_memory = False
    if mode == "inference" or n_valid == 0:
        path = "stats"
    elif mode == "frozen":
        key = dtype_key(compute)
        small = n_valid < TUNING.frozen_recompute_rows[key] and n_valid * hidden < TUNING.frozen_recompute_below[key]
        path = "frozen" if TUNING.frozen_two_gemm and compute != torch.float16 and not small else "recompute"
    else:
        path, flat_for_memory = _trainable_path(compute, softcap, n_valid, vocab, device, hidden, weight_bytes)
    record_path(path, flat_for_memory)
    return path


def frozen_backward(hidden, weight, y, g, ge, acc, logprobs, entropy, tlogit, softcap, logit_scale, inv_t, compute,
                    rows):
    """dX of the frozen path: elementwise from A, B and the statistics (`frozen.frozen_input_grad`)."""
    if logprobs.numel() == 0:
        return torch.zeros_like(hidden)
    n, k = logprobs.shape[0], hidden.shape[1]
    out = torch.empty((n, k), device=hidden.device, dtype=hidden.dtype)
    omp = -torch.expm1(logprobs)  # 1 − p_y, exact as p_y → 1
    has_ge = ge is not None and entropy is not None
    br, bh = 32, 128
    frozen_dx_kernel[(triton.cdiv(n, br), triton.cdiv(k, bh))](
        acc, weight, y, g if g is not None else omp, ge if has_ge else omp, logprobs, omp,
        entropy if has_ge else omp, tlogit, out, n, k, acc.stride(0), weight.stride(0), out.stride(0),
        float(inv_t * logit_scale), 1.0 / (float(softcap) * inv_t) if softcap is not None else 1.0,
        HAS_G=g is not None, HAS_GE=has_ge, HAS_B=acc.shape[0] == 2, HAS_SOFTCAP=softcap is not None,
        COMPUTE=TL_DTYPE[compute], BR=br, BH=bh, num_warps=4)
    return scatter_grad(out, hidden, rows)


def materialized_backward(extra, hidden, weight, bias, y, g, ge, entropy, scale, compute, rows, need_h, need_w,
                          need_b):
    """The kept probabilities become dZ, then cuBLAS: dX = dZ @ W, dW = dZᵀ @ X, db = Σ dZ. Without an entropy
    gradient (`dz_free_backward`) dZ = b·P~' row by row (`_fold_target_entry`): the buffer is the GEMMs' operand as
    it is and b scales X and dX; else an elementwise pass turns the buffer into dZ in place."""
    full, logprobs, shift = extra  # (the caller resolves the forward's rows check: `function.py`, `checked`)
    m_rows, vocab = full.shape
    row_factor = None
    if materialized_backward_reads_only(ge):  # (g is not None: the caller has a gradient to pass)
        row_factor = _fold_target_entry(full, y, shift, logprobs, g, scale)
    else:
        bm, bn = 64, 128
        dummy = logprobs
        dz_from_p_kernel[(triton.cdiv(m_rows, bm), triton.cdiv(vocab, bn))](
            full, y, shift, logprobs, entropy, g if g is not None else dummy, ge if ge is not None else dummy,
            m_rows, vocab, full.stride(0), float(scale), HAS_G=g is not None, HAS_GE=ge is not None, BM=bm, BN=bn,
            num_warps=4)
    grad_h = grad_w = grad_b = None
    if need_h:
        w_c = weight.to(compute)
        grad_h = torch.mm(full, w_c, **_fp32_out(compute))
        if row_factor is not None:
            grad_h.mul_(row_factor.unsqueeze(-1))
        grad_h = scatter_grad(grad_h, hidden, rows)
    if need_w:
        h = hidden if rows is None else hidden.index_select(0, rows)
        h = h.to(compute)
        if row_factor is not None:  # (in the compute dtype: no fp32 copy of X beside the kept buffer)
            h = h * row_factor.unsqueeze(-1).to(compute)
        grad_w = torch.empty_like(weight)
        _mm_into(grad_w, full.t(), h)
    if need_b and bias is not None:
        if row_factor is None:
            grad_b = full.sum(0, dtype=torch.float32)
        else:
            grad_b = torch.mm(row_factor.unsqueeze(0).to(compute), full, **_fp32_out(compute)).squeeze(0)
    return grad_h, grad_w, grad_b


def materialized_backward_reads_only(ge) -> bool:
    """Whether `materialized_backward` leaves the kept buffer usable again: the dZ-free backward only rewrites each
    row's target entry (the same value again on a second run); the elementwise pass turns the buffer into dZ."""
    return ge is None and TUNING.dz_free_backward


def _fp32_out(compute: torch.dtype) -> dict:
    """torch.mm's keyword for an fp32 result of 16-bit operands (none needed for fp32 ones)."""
    return {} if compute == torch.float32 else {"out_dtype": torch.float32}


def _fold_target_entry(full, y, shift, logprobs, g, scale):
    """Makes the kept e^(z − ref) an operand of the backward's GEMMs as it is: dZ_j = scale·g·(δ_jy − p_j) and
    p_j = e^(z_j − ref)·e^shift, so dZ = b·P~' with b = −scale·g·e^shift per row and P~' the buffer with its target
    entry replaced by −(1 − p_y)·e^−shift (one store per row; 1 − p_y from the fp32 log-prob, exact as p_y → 1, as
    the elementwise pass has it). Returns b. |P~'_y| ≤ Σ P~ ≤ V·e^ref_headroom: inside the 16-bit range."""
    one_minus_p = -torch.expm1(logprobs)
    entry = -one_minus_p * torch.exp(-shift)
    big = torch.finfo(full.dtype).max
    full[torch.arange(full.shape[0], device=full.device), y] = entry.clamp(-big, big).to(full.dtype)
    return -float(scale) * torch.exp(shift) * g


def recompute_backward(hidden, weight, bias, y, log_z, entropy, g, ge, rows, softcap, logit_scale, inv_t, compute,
                       n_valid, need_h, need_w, need_b, dz_tile):
    """The memory-lean backward: recompute each [token tile, vocabulary chunk] of logits in the fused kernel, write
    dZ once into a `dz_tile` (tokens, vocabulary) buffer, then cuBLAS (fp32: split-TF32 GEMMs, `split_tf32`) for dX and
    dW (vocabulary-outer, so each chunk's weight gradient is finished at once)."""
    dev = hidden.device
    vocab, k = weight.shape
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros(vocab, device=dev, dtype=torch.float32) if (need_b and bias is not None) else None
    grad_h_valid = torch.zeros((n_valid, k), device=dev, dtype=torch.float32) if need_h else None
    if n_valid > 0 and (g is not None or ge is not None) and (need_h or need_w or need_b):
        h = (hidden if rows is None else hidden.index_select(0, rows)).contiguous()
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
        # fp32: dX and dW as split-TF32 GEMMs on K-major copies (`split_tf32`), else cuBLAS
        split = None
        if (TUNING.fp32_mm == "triton" and compute == torch.float32 and weight.dtype == torch.float32
                and h.dtype == torch.float32):
            split = SplitTF32Gradients(k, t_tile, v_tile, dev, need_h, need_w)
        for v0 in range(0, vocab, v_tile):
            v1 = min(v0 + v_tile, vocab)
            w_c = weight[v0:v1].to(compute)
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
                compiled = bwd_kernel[(n_progs,)](
                    h_arg, w_arg, bias if bias is not None else h, y[t0:t1], log_z[t0:t1],
                    entropy[t0:t1], g[t0:t1] if g is not None else dummy, ge[t0:t1] if ge is not None else dummy,
                    dz_arg, rows_t, v0, v1, k, h.stride(0), weight.stride(0), tile.stride(0),
                    float(logit_scale), float(softcap or 1.0), float(inv_t),
                    HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_G=g is not None,
                    HAS_GE=ge is not None, COMPUTE=TL_DTYPE[compute], PRECISION=_precision(compute),
                    EVEN_K=k % bk == 0, USE_TMA=tma, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                    PERSISTENT=persistent, NUM_PROGRAMS=n_progs, DZ_TMA=dz_tma,
                    FAST_EXP=h.is_cuda and TUNING.fast_exp,
                    num_warps=warps, num_stages=stages, **TUNING.launch_options[f"bwd_{dtype_key(compute)}"])
                LAST_COMPILED[f"bwd_{dtype_key(compute)}"] = compiled
                if split is not None:
                    if n_ttiles > 1 or v0 == 0:  # Xᵀ of this token tile (once, when all tokens fit one)
                        split.rows(h[t0:t1])
                    split.add(tile, w_c, grad_h_valid[t0:t1] if need_h else None, grad_w[v0:v1] if need_w else None)
                else:
                    if need_h:
                        _mm_acc(grad_h_valid[t0:t1], tile, w_c)
                    if need_w and n_ttiles == 1:
                        _mm_into(grad_w[v0:v1], tile.t(), h_c[t0:t1])
                    elif need_w:
                        _mm_acc(grad_w[v0:v1] if dw_buf is None else dw_buf[: v1 - v0], tile.t(), h_c[t0:t1])
                if grad_b is not None:
                    grad_b[v0:v1] += tile.sum(0, dtype=torch.float32)
            if dw_buf is not None:
                grad_w[v0:v1].copy_(dw_buf[: v1 - v0])
    grad_h = None
    if need_h:
        grad_h = scatter_grad(grad_h_valid, hidden, rows)
    return grad_h, grad_w, grad_b

