"""The Triton kernel's tuning in one documented dataclass, `KernelTuning`, and the instance the kernel reads: `TUNING`.

Chosen on an H200 with `benchmarks/loss_bench.py --tune` (docs/kernel.md). The `GRPO_LAB_*` variables are applied
once, by `KernelTuning.from_env` at import; the kernel reads `TUNING` at every call, so an experiment changes a field
and the next call runs with it. No Triton import: the planner and the benchmark read these values on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from grpo_lab.lab import environment

DTYPE_KEYS = ("16", "32")  # per-compute-dtype tables: "16" (bf16 / fp16) and "32" (fp32)

# Tile configuration per compute dtype: (BM, BN, BK, GROUP_M, num_warps, num_stages).
_CONFIGS = {
    "fwd_16": (128, 256, 64, 8, 8, 3),
    "bwd_16": (128, 256, 64, 8, 8, 3),
    "fwd_32": (128, 128, 32, 8, 8, 3),
    "bwd_32": (128, 128, 32, 8, 8, 3),
    "mm_32": (128, 128, 32, 8, 8, 3),
    # the frozen head's forward (statistics + the P~ store), tuned apart from the statistics-only forward: with
    # the lean epilogue (issue 45) the wide tile is back, 36.0 vs 38.9 ms (128 x 128, 4 stages) at H = 1024, 32k
    # tokens, 130.7 vs 146.3 at H = 4096, head alone on an H100: 128 x 128 tiles cost their main loop 12-17 %
    # against cuBLAS, 128 x 256 tiles none (results/loss_kernel/h100_issue45_lean/)
    "frozen_16": (128, 256, 64, 8, 8, 3),
    "frozen_32": (128, 128, 32, 8, 8, 3),
}
PERSISTENT_KEYS = tuple(k for k in _CONFIGS if k.startswith(("fwd", "bwd")))  # the frozen forward follows fwd


@dataclass
class KernelTuning:
    r"""
    Every setting of the fused linear → log-prob kernel that is not part of its result (tiles, launch styles, which
    path a head takes). Per-dtype tables are keyed "16" (bf16 / fp16) and "32" (fp32); per-kernel ones as `configs`.
    The H200 / H100 measurements behind each default are in docs/kernel.md and results/loss_kernel/.

    Args:
        configs (`dict`):
            Tile configuration per kernel and compute dtype, `(BM, BN, BK, GROUP_M, num_warps, num_stages)`, keys
            `fwd_16`, `bwd_16`, `fwd_32`, `bwd_32`, `mm_32` (the fp32 path's Triton GEMM), `frozen_16`, `frozen_32`.
        use_tma (`bool`, defaults to `True`, `GRPO_LAB_TMA`):
            Tensor-descriptor (TMA) loads in the fused kernels where the strides allow.
        fp32_mm (`str`, defaults to `"triton"`, `GRPO_LAB_FP32_MM`):
            The fp32 path's dX / dW GEMMs: `"triton"` (split-TF32 when `fp32_dot` is `"tf32x3"`, on K-major copies
            of the operands: `split_tf32`) or `"cublas"` (plain SGEMM, TF32 off). On one H100 the split GEMMs took
            the memory-flat trainable head at H = 4096, 8k tokens from 650 to 544 ms (naive: 622), at the same
            loss peak: the copies fit in what the fp32 dZ tile's 4096 tokens save against 8192.
        fp32_mm_slice (`int`, defaults to 2048, `GRPO_LAB_FP32_MM_SLICE`):
            Vocabulary columns per K-major copy of `fp32_mm = "triton"`: W[slice]ᵀ and dZ[:, slice]ᵀ are
            slice × H and slice × tokens fp32 buffers.
        direct_launch (`bool`, defaults to `False`):
            Launches after the first of each specialisation in a loop of vocabulary chunks go straight to the kernel
            Triton compiled, without its per-launch dispatch (`relaunch`): for a host-bound small head. Opt-in until
            a GPU run has timed it (`benchmarks/issue45_h100.sh split`).
        fp32_dot (`str`, defaults to `"tf32x3"`, `GRPO_LAB_FP32_DOT`):
            fp32 dot products: `"ieee"` (plain fp32 FMA) or `"tf32x3"` (three TF32 products, fp32-level error, on
            tensor cores).
        bwd_tile (`dict`, `GRPO_LAB_BWD_TOKENS` / `GRPO_LAB_BWD_VOCAB` set both dtypes):
            The backward's dZ buffer, (tokens, vocabulary), per dtype: 16384 × 8192 for 16-bit (K = 16384 halves the
            cuBLAS dW GEMM's fp32 accumulator passes), 4096 × 8192 for fp32 (with the split-TF32 copies, the bytes
            8192 × 8192 took with cuBLAS: loss memory under 0.8× TRL's).
        part_budget_bytes (`int`, defaults to 32 MiB):
            Bytes of the forward's per-block partial statistics: how many vocabulary blocks one launch covers.
        merge_rows, merge_blocks (`int`, defaults to 128 and 32):
            Rows per program and vocabulary blocks per load of the partial-statistics merge.
        persistent (`dict`, `GRPO_LAB_PERSISTENT` lists the keys to turn on, `""` for none):
            Persistent launch per fused kernel and dtype (keys `fwd_16`, `bwd_16`, `fwd_32`, `bwd_32`; the frozen
            forward follows `fwd`): one program per SM loops over the tiles, the next tile's loads overlapping this
            tile's softmax epilogue. On for 16-bit (fp32 gained nothing); needs Triton 3.3+'s `tl.range(flatten=)`.
        persistent_programs (`int` or `None`, defaults to `None`):
            Programs of a persistent launch: `None` = one per SM (3 off CUDA, for Triton's interpreter), fewer when
            there are fewer tiles (a compile-time constant: such launches compile a bounded few variants).
        programs_per_sm (`dict`, keys as `configs`, defaults to 1):
            Programs per SM of a persistent launch: 2 lets one's softmax epilogue overlap the other's tensor-core work.
        launch_options (`dict`, keys as `configs`):
            Extra Triton compile options per kernel (e.g. `{"maxnreg": 128}`: two 8-warp programs on one SM).
        dz_tma (`dict`, defaults on for 16-bit, `GRPO_LAB_DZ_TMA=0/1` sets both):
            The backward writes dZ through a tensor descriptor when TMA loads are on: since the leaner epilogue the
            plain stores' int64 pointer tile is what spills the recomputing backward's registers (1.6 KiB per thread
            on sm_90a); 0-3 % faster on an H100 (no gain on the H200 before). fp32 was not measured: off.
        p_tma (`dict`, defaults on for 16-bit, `GRPO_LAB_P_TMA=0/1` sets both):
            The frozen forward stores its P~ blocks, and the materialised head's forward its kept probabilities,
            through a tensor descriptor (a bulk copy the next tile's loads overlap) when TMA loads are on; fp32 was
            not measured, so it is off there.
        frozen_two_gemm (`bool`, defaults to `True`; `GRPO_LAB_FROZEN=recompute` turns it off):
            A frozen head (only the hidden states need a gradient) takes the two-GEMM path (the forward accumulates
            Σ p·W, the backward is elementwise) rather than the trainable head's recomputing backward.
        frozen_recompute_rows, frozen_recompute_below (`dict`; `GRPO_LAB_FROZEN_RECOMPUTE_BELOW` sets 16-bit's):
            A frozen head with fewer than `frozen_recompute_rows` valid rows (0: the rule is off, since the two-GEMM
            forward stopped syncing with the host and is faster at every size measured) and rows × hidden below
            `frozen_recompute_below` takes the recompute path (dX only), its dZ tile the P~ tile's budget.
        frozen_deferred_check (`dict`, per dtype, defaults on for 16-bit):
            The frozen forward checks overflowing rows without a host sync: statistics against each block's max, the
            count of rows to recompute copied to pinned memory behind an event the backward waits for, which then
            repairs those rows' A and B. Off (fp32, not measured): one host sync in the forward.
        materialized_deferred_check (`dict`, per dtype, defaults on for 16-bit):
            The same for the materialised head: statistics against each block's max, the rows whose kept
            probabilities may have overflowed recomputed by the backward, so the forward has no host sync (which
            left the GPU idle while the host queued the rest of the loss). Off (fp32, not measured): one host sync in
            the forward, statistics against ref (`ref_stats`).
        frozen_tile (`dict`):
            The frozen path's P~ buffer, (tokens, vocabulary): 132 MiB bf16 / 264 MiB fp32, widened in the vocabulary
            when there are fewer rows. 8448 = 33 blocks of 256 (66 of 128): with 64 row tiles a launch is 2112 (4224)
            tiles, whole waves of 132 SMs (H100 / H200), where 8192 left the last of 16 (32) waves half empty, and
            every power-of-two row count under 8192 widens to the same tile count. Frozen bf16 loss steps 0.2-3.2 %
            faster than with 8192 on an H100 in 8 of 9 interleaved comparisons, the ninth an outlier round (issue 45,
            results/loss_kernel/h100_issue45_timeline/).
        fast_exp (`bool`, defaults to `True`; `GRPO_LAB_LEAN_EPILOGUE=0` turns it and the next two off):
            The fused kernels' exponentials on a GPU as one `ex2.approx.ftz` (results under 2^-126 flush to 0) instead
            of `tl.exp`'s denormal-safe sequence, four instructions per element more. Triton's interpreter always
            uses `tl.exp`.
        target_zero_pass (`bool`, defaults to `True`):
            The frozen forward's P~ blocks get their target column zeroed by one store per row in the merge of the
            launch's statistics (`merge_kernel`) instead of by a compare and select on every element of the fused
            forward's epilogue (issue 45: the epilogue, not the GEMM, is the forward's distance to its floor).
        target_logit_from_ref (`bool`, defaults to `True`):
            A forward with a per-row ref (frozen and materialised heads, `ref_stats_plain`) takes each row's target
            logit from that ref, the row-wise fp32 dot `ref_logit_kernel` computes anyway, instead of finding the
            target's column in every block of its epilogue (a compare and select per element); not when is_top1 is
            asked for (it compares the target logit with the row max, so needs the blocks' own value). Off: always
            from the block.
        dz_free_backward (`bool`, defaults to `True`):
            The materialised head's backward without an entropy gradient has no elementwise dZ pass: dZ of a row is
            b·P~ with one factor b per row and the target's entry set to −(1 − p_y)·e^(log Z − ref) (one store per
            row), so the kept P~ is itself the operand of the dX and dW GEMMs and b scales X before one and dX
            after the other. This saves a read and a write of the [N, V] buffer (the materialised head alone: 47.5
            vs 55.1 ms at H = 1024, 32k tokens, on an H100); dZ is also no longer rounded to the compute dtype.
        ref_headroom (`float`, defaults to 60):
            e^(z − ref) is stored against a per-row reference (the target's logit); rows whose max exceeds it by more
            than this are recomputed against their exact max (e^60 · V stays far inside the fp32 / bf16 range).
        sq_ref_headroom (`float`, defaults to 30):
            With `ref_stats`, Σ e^(2(z − ref)) (log Σp², when asked for) overflows fp32 once the max is ~38 nats
            above ref: rows with a larger gap are recomputed against their max when that statistic is wanted.
        plogp_excess (`dict`, defaults 2 for 16-bit, infinity for fp32):
            With an entropy gradient expected, P~·(z − ref) is rounded to the compute dtype, an error of about
            p_max·(max − ref)·eps relative to A; rows where p_max·(max − ref) exceeds this are recomputed against
            their max (tests/kernels/test_frozen_rebase_cpu.py). fp32 rounds finely enough for the overflow guard.
        materialize_fraction (`float`, defaults to 0.5, `GRPO_LAB_MATERIALIZE_FRACTION`):
            The memory policy of a trainable head (`policy.py`): it keeps its [N, V] probabilities in the compute
            dtype (no recompute in the backward: three GEMMs instead of four) when that buffer is at most this
            fraction of the device memory free at that moment, with 2 GiB to spare (and, with
            `materialize_within_peak`, fits under the run's peak); else it stays memory-flat. 0: always flat.
        materialize_within_peak (`bool`, defaults to `True`, `GRPO_LAB_MATERIALIZE_WITHIN_PEAK=0/1`):
            Under the fraction (not an explicit allowance), keep the buffer only where it and the head's backward
            outputs fit between what is allocated now and the allocator's high-water mark (an earlier step's peak:
            its backward, its optimizer step), so the buffer never raises the run's peak memory: the head runs at the
            top of the activation peak, where free memory says nothing about the rest of the step. The first step
            is flat; later ones keep the buffer where the step's peak lies elsewhere. Off: the free memory alone
            decides (faster where memory is spare, but a step's peak grows by the buffer).
        materialize_flat_below (`dict`, `GRPO_LAB_MATERIALIZE_FLAT_BELOW` sets 16-bit's):
            Under the fraction (not an explicit allowance), a trainable head with rows × hidden below this stays flat
            whatever is free: so small a step is bound by host work, and the materialised path's reference dot and
            host sync cost more than its saved GEMM. fp32: 0.
        materialize_gib (`float` or `None`, defaults to `None`, `GRPO_LAB_MATERIALIZE_GIB`):
            An explicit allowance, in GiB, replacing `materialize_fraction`: the buffer is kept when it is at most
            this and fits in the free memory with 2 GiB to spare. 0: always flat. `None`: the fraction decides.
        ref_stats (`dict`, defaults on, `GRPO_LAB_REF_STATS=0/1` sets both):
            A forward that stores e^(z − ref) (frozen and materialised heads) takes its statistics against that same
            per-row ref instead of each block's max (no row max to reduce first, sums add without rescaling); they
            are brought back to the row max at the end, a row over `ref_headroom` recomputed against its max.
        ref_stats_plain (`dict`, defaults off, `GRPO_LAB_REF_STATS_PLAIN=0/1` sets both):
            The statistics-only forward (a trainable head's, and old / reference log-probs) against the same kind of
            ref: the target's logit from a row-wise dot first, the same rescue after.
    """

    configs: dict = field(default_factory=lambda: dict(_CONFIGS))
    use_tma: bool = True
    fp32_mm: str = "triton"
    fp32_mm_slice: int = 2048
    direct_launch: bool = False
    fp32_dot: str = "tf32x3"
    bwd_tile: dict = field(default_factory=lambda: {"16": (16384, 8192), "32": (4096, 8192)})
    part_budget_bytes: int = 32 * 2**20
    merge_rows: int = 128
    merge_blocks: int = 32
    persistent: dict = field(default_factory=lambda: {key: key.endswith("_16") for key in PERSISTENT_KEYS})
    persistent_programs: int | None = None
    programs_per_sm: dict = field(default_factory=lambda: dict.fromkeys(_CONFIGS, 1))
    launch_options: dict = field(default_factory=lambda: {key: {} for key in _CONFIGS})
    dz_tma: dict = field(default_factory=lambda: {"16": True, "32": False})
    p_tma: dict = field(default_factory=lambda: {"16": True, "32": False})
    frozen_two_gemm: bool = True
    frozen_recompute_rows: dict = field(default_factory=lambda: {"16": 0, "32": 0})
    frozen_recompute_below: dict = field(default_factory=lambda: {"16": 9 * 2**19, "32": 0})
    frozen_deferred_check: dict = field(default_factory=lambda: {"16": True, "32": False})
    materialized_deferred_check: dict = field(default_factory=lambda: {"16": True, "32": False})
    frozen_tile: dict = field(default_factory=lambda: {"16": (8192, 8448), "32": (8192, 8448)})
    fast_exp: bool = True
    target_zero_pass: bool = True
    target_logit_from_ref: bool = True
    dz_free_backward: bool = True
    ref_headroom: float = 60.0
    sq_ref_headroom: float = 30.0
    plogp_excess: dict = field(default_factory=lambda: {"16": 2.0, "32": float("inf")})
    materialize_fraction: float = 0.5
    materialize_flat_below: dict = field(default_factory=lambda: {"16": 2**22, "32": 0})
    materialize_gib: float | None = None
    materialize_within_peak: bool = True
    ref_stats: dict = field(default_factory=lambda: dict.fromkeys(DTYPE_KEYS, True))
    ref_stats_plain: dict = field(default_factory=lambda: dict.fromkeys(DTYPE_KEYS, False))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelTuning:
        """The defaults with the `GRPO_LAB_*` variables of `environ` (the process environment by default) applied
        (`environment.KERNEL_VARIABLES`, each documented in the class docstring)."""
        get = environment.kernel_variables(environ).get
        tuning = cls()

        def switch(name, default: bool) -> bool:  # a 0/1 variable; anything else is an error, not "off"
            value = get(name, "1" if default else "0")
            if value not in ("0", "1"):
                raise ValueError(f"GRPO_LAB_{name}={value!r}: 0 or 1")
            return value == "1"

        def both(name, defaults):  # a 0/1 switch: the variable sets both dtypes, else each keeps its default
            return {key: get(name, "1" if on else "0") == "1" for key, on in defaults.items()}

        tuning.use_tma = get("TMA", "1") == "1"
        tuning.fp32_mm = get("FP32_MM", tuning.fp32_mm)
        tuning.fp32_dot = get("FP32_DOT", tuning.fp32_dot)
        if tuning.fp32_mm not in ("triton", "cublas"):
            raise ValueError(f"GRPO_LAB_FP32_MM={tuning.fp32_mm!r}: triton or cublas")
        tuning.fp32_mm_slice = int(get("FP32_MM_SLICE", tuning.fp32_mm_slice))
        if tuning.fp32_mm_slice < 1:
            raise ValueError(f"GRPO_LAB_FP32_MM_SLICE={tuning.fp32_mm_slice}: a positive number of columns")
        tuning.bwd_tile = {key: (int(get("BWD_TOKENS", tokens)), int(get("BWD_VOCAB", vocab)))
                           for key, (tokens, vocab) in tuning.bwd_tile.items()}
        listed = get("PERSISTENT", None)
        if listed is not None:
            on = [k.strip() for k in listed.split(",") if k.strip()]
            if set(on) - set(PERSISTENT_KEYS):
                raise ValueError(f"GRPO_LAB_PERSISTENT={listed!r}: keys are {sorted(PERSISTENT_KEYS)}")
            tuning.persistent = {key: key in on for key in PERSISTENT_KEYS}
        tuning.dz_tma = both("DZ_TMA", tuning.dz_tma)
        tuning.p_tma = both("P_TMA", tuning.p_tma)
        tuning.frozen_two_gemm = get("FROZEN", "two_gemm") != "recompute"
        tuning.frozen_recompute_below["16"] = int(get("FROZEN_RECOMPUTE_BELOW", tuning.frozen_recompute_below["16"]))
        tuning.materialize_fraction = float(get("MATERIALIZE_FRACTION", tuning.materialize_fraction))
        if not 0.0 <= tuning.materialize_fraction <= 1.0:
            raise ValueError(f"GRPO_LAB_MATERIALIZE_FRACTION={tuning.materialize_fraction}: a fraction in [0, 1]")
        tuning.materialize_flat_below["16"] = int(get("MATERIALIZE_FLAT_BELOW", tuning.materialize_flat_below["16"]))
        gib = get("MATERIALIZE_GIB", "")
        tuning.materialize_gib = float(gib) if gib.strip() else None
        tuning.materialize_within_peak = switch("MATERIALIZE_WITHIN_PEAK", tuning.materialize_within_peak)
        if not switch("LEAN_EPILOGUE", True):  # issue 45's epilogue switches all off: the epilogue as measured before
            tuning.fast_exp = tuning.target_zero_pass = tuning.target_logit_from_ref = False
        tuning.ref_stats = both("REF_STATS", tuning.ref_stats)
        tuning.ref_stats_plain = both("REF_STATS_PLAIN", tuning.ref_stats_plain)
        return tuning


TUNING = KernelTuning.from_env()
