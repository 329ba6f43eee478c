"""The Triton kernel's tuning in one documented dataclass, `KernelTuning`, and the instance the kernel reads: `TUNING`.

Tile sizes, launch styles and path thresholds were chosen on an H200 with `benchmarks/loss_bench.py --tune` (the
measurements quoted below are in results/loss_kernel/; docs/kernel.md tells the story). The `GRPO_LAB_*`
environment variables (`grpo_lab.lab.environment.kernel_variables`) are applied in one place,
`KernelTuning.from_env`, once at import; the kernel reads `TUNING` at
every call, so an experiment (the benchmark's tile sweep, a test) changes a field of `TUNING` and the next call runs
with it. No Triton import here: the memory planner and the benchmark's report read these values on any machine.
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
    # the frozen head's forward (statistics + the P~ store), tuned apart from the statistics-only forward:
    # 128 x 128 x 64, 8 warps, 4 stages with P~ through descriptors: 42.7 vs 48.5 ms (128 x 256, 3 stages) at
    # H = 1024, 32k tokens, 138.5 vs 143.2 at H = 4096 (results/loss_kernel/tune_run4.csv)
    "frozen_16": (128, 128, 64, 8, 8, 4),
    "frozen_32": (128, 128, 32, 8, 8, 3),
}
PERSISTENT_KEYS = tuple(k for k in _CONFIGS if k.startswith(("fwd", "bwd")))  # the frozen forward follows fwd


@dataclass
class KernelTuning:
    r"""
    Every setting of the fused linear → log-prob kernel that is not part of its result (tiles, launch styles, which
    path a head takes). Per-dtype tables are keyed "16" (bf16 / fp16) and "32" (fp32); per-kernel ones as `configs`.

    Args:
        configs (`dict`):
            Tile configuration per kernel and compute dtype, `(BM, BN, BK, GROUP_M, num_warps, num_stages)`, keys
            `fwd_16`, `bwd_16`, `fwd_32`, `bwd_32`, `mm_32` (the fp32 path's Triton GEMM), `frozen_16`, `frozen_32`.
        use_tma (`bool`, defaults to `True`, `GRPO_LAB_TMA`):
            Tensor-descriptor (TMA) loads in the fused kernels where the strides allow: 21.6 vs 24.0 ms for the bf16
            B=64 forward on the H200 (tune_run2.csv).
        fp32_mm (`str`, defaults to `"cublas"`, `GRPO_LAB_FP32_MM`):
            The fp32 path's dX / dW GEMMs: `"cublas"` (plain SGEMM, TF32 off) or `"triton"` (split-TF32 when
            `fp32_dot` is `"tf32x3"`).
        fp32_dot (`str`, defaults to `"tf32x3"`, `GRPO_LAB_FP32_DOT`):
            fp32 dot products: `"ieee"` (plain fp32 FMA) or `"tf32x3"` (three TF32 products, fp32-level error, on
            tensor cores).
        bwd_tile (`dict`, `GRPO_LAB_BWD_TOKENS` / `GRPO_LAB_BWD_VOCAB` set both dtypes):
            The backward's dZ buffer, (tokens, vocabulary), per dtype. 16-bit 16384 × 8192 (256 MiB bf16; K = 16384
            for the cuBLAS dW GEMM, half the fp32 accumulator passes): 71.5 vs 71.7 ms at 8192 × 8192 with the
            persistent kernels (73.8 vs 75.2 without); fp32 keeps 8192 × 8192 (256 MiB), which holds its loss memory
            under 0.8× TRL's (tune_run3.csv).
        part_budget_bytes (`int`, defaults to 32 MiB):
            Bytes of the forward's per-block partial statistics: how many vocabulary blocks one launch covers.
        merge_rows, merge_blocks (`int`, defaults to 128 and 32):
            Rows per program and vocabulary blocks per load of the partial-statistics merge.
        persistent (`dict`, `GRPO_LAB_PERSISTENT` lists the keys to turn on, `""` for none):
            Persistent launch per fused kernel and dtype (keys `fwd_16`, `bwd_16`, `fwd_32`, `bwd_32`; the frozen
            forward follows `fwd`): one program per SM loops over the tiles, its loop flattened with the K loop so
            the next tile's loads are issued while this tile's softmax epilogue runs. On for 16-bit: bf16 B=64 head
            fwd+bwd 71.7 vs 75.2 ms on the H200 (tune_run3.csv); fp32 gained nothing (662 vs 658 ms). Needs a
            Triton whose `tl.range` has `flatten` (3.3+); older ones get one program per tile.
        persistent_programs (`int` or `None`, defaults to `None`):
            Programs of a persistent launch: `None` = one per SM (3 off CUDA, for Triton's interpreter), fewer when
            there are fewer tiles. A compile-time constant: launches of under one program per SM compile their own
            variant (a bounded few: small token tiles and the last vocabulary chunk).
        programs_per_sm (`dict`, keys as `configs`, defaults to 1):
            Programs per SM of a persistent launch: 2 lets two programs share an SM when their registers and shared
            memory allow it, so one's softmax epilogue can overlap the other's tensor-core work.
        launch_options (`dict`, keys as `configs`):
            Extra Triton compile options per kernel (e.g. `{"maxnreg": 128}`, which lets two 8-warp programs fit one
            SM).
        dz_tma (`dict`, defaults off, `GRPO_LAB_DZ_TMA=1` turns both on):
            The backward writes dZ through a tensor descriptor (bulk store, clipped at the tile's edges) when TMA
            loads are on. No gain on the H200 (tune_run3.csv).
        p_tma (`dict`, defaults on for 16-bit, `GRPO_LAB_P_TMA=0/1` sets both):
            The frozen forward stores its P~ blocks through a tensor descriptor (an asynchronous bulk copy the next
            tile's loads can overlap) when TMA loads are on; on for 16-bit with the frozen tiles above, off for fp32
            (not measured there).
        frozen_two_gemm (`bool`, defaults to `True`; `GRPO_LAB_FROZEN=recompute` turns it off):
            A frozen head (only the hidden states need a gradient) takes the two-GEMM path (the forward accumulates
            Σ p·W, the backward is elementwise) rather than the trainable head's recomputing backward.
        frozen_recompute_rows, frozen_recompute_below (`dict`; `GRPO_LAB_FROZEN_RECOMPUTE_BELOW` sets 16-bit's):
            A frozen head with fewer than `frozen_recompute_rows` valid rows (0 by default: the rule is off) and rows ×
            hidden below `frozen_recompute_below` takes the recompute path (dX only). It was on (4096 rows for 16-bit)
            while the two-GEMM forward synced with the host: with the rows check deferred (above) and its rebase
            fused, the two-GEMM path is faster at every size measured (H100, h100_issue45/small_head_run2.csv: 2048 ×
            1024 / 1536 / 2048 5.06 / 6.66 / 7.59 ms against 5.52 / 7.56 / 8.64 for the rule with the sync, the old
            default; 4096 × 1536 10.17 vs 10.84). Before that, H200, bf16,
            head fwd+bwd (tune_run4.csv, tune_run5.csv): recompute 3.8 / 5.2 / 6.4 / 5.6 ms against 4.6 / 5.7 / 7.3
            / 5.9 at 2048 rows × H 1024 / 1536 / 2048 and 3072 × 1024; two-GEMM ahead from 3072 × 1536 (7.2 vs 7.6)
            and at 2048 × 4096 (9.8 vs 12.4); in the whole loss at 4096 × 1024 two-GEMM 7.7 ms, recompute 8.5 (TRL
            8.0-8.2; loss_grid.csv). Its dZ tile keeps the frozen P~ tile's budget (same memory).
        frozen_deferred_check (`dict`, per dtype, defaults on for 16-bit):
            The frozen forward's check of overflowing rows without a host sync: its statistics are taken against each
            block's max (exact whatever the ref), the count of rows to recompute is copied to pinned host memory
            behind an event, and the backward waits for that event alone and repairs those rows' A and B (rare). Off:
            the forward checks them itself, one host sync, after which the GPU idles while the host queues the loss.
            H100, bf16 loss fwd+bwd, median of 5 interleaved rounds (results/loss_kernel/h100_issue45/
            small_head_run2.csv): 2048 rows × H 1024 / 1536 / 2048 5.06 / 6.66 / 7.59 ms against 5.54 / 7.72 / 8.33
            with the sync (TRL 5.35 / 7.30 / 8.53); 4096 × 1024 8.06 vs 8.63; 8192 × 1024 13.39 vs 13.58. fp32 (not
            measured) keeps the sync.
        frozen_tile (`dict`):
            The frozen path's P~ buffer, (tokens, vocabulary): 128 MiB bf16 / 256 MiB fp32, widened in the vocabulary
            when there are fewer rows. (16384 × 8192 bf16 held the loss peak at 0.59 GiB at B = 64, H = 1024, over
            TRL's 0.44: results/loss_kernel, run 5.)
        ref_headroom (`float`, defaults to 60):
            e^(z − ref) is stored against a per-row reference (the target's logit); rows whose max exceeds it by more
            than this are recomputed against their exact max (e^60 · V stays far inside the fp32 / bf16 range).
        sq_ref_headroom (`float`, defaults to 30):
            With `ref_stats`, Σ e^(2(z − ref)) (log Σp², when asked for) overflows fp32 once the max is ~38 nats
            above ref (V·e^(2·gap) > 3.4e38), and its way back to the max multiplies by e^(−2·gap): rows with a
            larger gap are recomputed against their max when that statistic is wanted.
        plogp_excess (`dict`, defaults 2 for 16-bit, infinity for fp32):
            With an entropy gradient expected, P~·(z − ref) is rounded to the compute dtype before its GEMM, and the
            rebase B − (log Z − ref)·A cancels the largest entry's share of B: its rounding error, relative to A, is
            about p_max·(max − ref)·eps (bf16: 2^-9), 5 % of dX for peaked rows whose target sits 20-60 nats below
            the max. Rows where p_max·(max − ref) exceeds this are recomputed against their max. With targets sampled
            from the policy, 2 rescues 4-7 % of rows and leaves dX within 1.7e-3 of float64
            (tests/kernels/test_frozen_rebase_cpu.py); a plain 1-nat gap rule rescued 13-62 %. fp32 rounds 2^16
            times finer: only the overflow guard applies there.
        materialize_fraction (`float`, defaults to 0.5, `GRPO_LAB_MATERIALIZE_FRACTION`):
            The memory policy of a trainable head (`policy.py`): it keeps its [N, V] probabilities in the compute
            dtype (the backward then needs no recompute: three GEMMs instead of four; on the H200 the whole loss is
            11-26 % faster from 8192 rows in bf16, 12-20 % in fp32, loss_grid_run11.csv) when
            that buffer is at most this fraction of the device memory free at that moment, with 2 GiB to spare;
            otherwise it stays memory-flat. Half leaves the other half for what the step allocates while the buffer
            lives, so a step that fits flat also fits with it, and a batch at the memory limit stays flat. 0: always
            flat.
        materialize_flat_below (`dict`, `GRPO_LAB_MATERIALIZE_FLAT_BELOW` sets 16-bit's):
            Under the fraction (not an explicit allowance), a trainable head with rows × hidden below this stays flat
            whatever is free: so small a step is bound by host work, and the materialised path's reference dot and
            host sync cost more than its saved GEMM. H200, bf16, whole loss (loss_grid_run11.csv): materialised 7.58
            / 8.92 ms against flat 6.77 / 8.51 at 2048 rows × H 1024 / 1536, 11.09 vs 10.94 at 4096 × 1024;
            materialised ahead at 2048 × 2048 (9.74 vs 10.13) and everywhere above. fp32 (0): materialised ahead
            from 2048 × 1024 (40.4 vs 46.0 ms).
        materialize_gib (`float` or `None`, defaults to `None`, `GRPO_LAB_MATERIALIZE_GIB`):
            An explicit allowance, in GiB, replacing `materialize_fraction`: the buffer is kept when it is at most
            this and fits in the free memory with 2 GiB to spare (the opt-in of earlier versions, whose default 0
            meant never). 0: always flat. `None`: the fraction decides.
        ref_stats (`dict`, defaults on, `GRPO_LAB_REF_STATS=0/1` sets both):
            A forward that stores e^(z − ref) (frozen and materialised heads) takes its statistics against that same
            per-row ref instead of each block's max: the exponentials start as soon as the logits are there (no row
            max to reduce and broadcast first, fewer live registers) and the partial sums add without rescaling. The
            sums are brought back to the row max once at the end; a row whose max is over `ref_headroom` above ref
            is recomputed, statistics included, against its max.
        ref_stats_plain (`dict`, defaults off, `GRPO_LAB_REF_STATS_PLAIN=0/1` sets both):
            The statistics-only forward (a trainable head's, and old / reference log-probs) against the same kind of
            ref: the target's logit from a row-wise dot first, the same rescue after.
    """

    configs: dict = field(default_factory=lambda: dict(_CONFIGS))
    use_tma: bool = True
    fp32_mm: str = "cublas"
    fp32_dot: str = "tf32x3"
    bwd_tile: dict = field(default_factory=lambda: {"16": (16384, 8192), "32": (8192, 8192)})
    part_budget_bytes: int = 32 * 2**20
    merge_rows: int = 128
    merge_blocks: int = 32
    persistent: dict = field(default_factory=lambda: {key: key.endswith("_16") for key in PERSISTENT_KEYS})
    persistent_programs: int | None = None
    programs_per_sm: dict = field(default_factory=lambda: dict.fromkeys(_CONFIGS, 1))
    launch_options: dict = field(default_factory=lambda: {key: {} for key in _CONFIGS})
    dz_tma: dict = field(default_factory=lambda: dict.fromkeys(DTYPE_KEYS, False))
    p_tma: dict = field(default_factory=lambda: {"16": True, "32": False})
    frozen_two_gemm: bool = True
    frozen_recompute_rows: dict = field(default_factory=lambda: {"16": 0, "32": 0})
    frozen_recompute_below: dict = field(default_factory=lambda: {"16": 9 * 2**19, "32": 0})
    frozen_deferred_check: dict = field(default_factory=lambda: {"16": True, "32": False})
    frozen_tile: dict = field(default_factory=lambda: {"16": (8192, 8192), "32": (8192, 8192)})
    ref_headroom: float = 60.0
    sq_ref_headroom: float = 30.0
    plogp_excess: dict = field(default_factory=lambda: {"16": 2.0, "32": float("inf")})
    materialize_fraction: float = 0.5
    materialize_flat_below: dict = field(default_factory=lambda: {"16": 2**22, "32": 0})
    materialize_gib: float | None = None
    ref_stats: dict = field(default_factory=lambda: dict.fromkeys(DTYPE_KEYS, True))
    ref_stats_plain: dict = field(default_factory=lambda: dict.fromkeys(DTYPE_KEYS, False))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelTuning:
        """The defaults with the `GRPO_LAB_*` variables of `environ` (the process environment by default) applied:
        `TMA`, `FP32_MM`, `FP32_DOT`, `BWD_TOKENS`, `BWD_VOCAB`, `PERSISTENT`, `DZ_TMA`, `P_TMA`, `FROZEN`,
        `FROZEN_RECOMPUTE_BELOW`, `MATERIALIZE_FRACTION`, `MATERIALIZE_FLAT_BELOW`, `MATERIALIZE_GIB`, `REF_STATS`,
        `REF_STATS_PLAIN`."""
        env = environment.kernel_variables(environ)
        tuning = cls()

        def get(name, default):
            return env.get(name, default)

        def both(name, defaults):  # a 0/1 switch: the variable sets both dtypes, else each keeps its default
            return {key: get(name, "1" if on else "0") == "1" for key, on in defaults.items()}

        tuning.use_tma = get("TMA", "1") == "1"
        tuning.fp32_mm = get("FP32_MM", tuning.fp32_mm)
        tuning.fp32_dot = get("FP32_DOT", tuning.fp32_dot)
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
        tuning.ref_stats = both("REF_STATS", tuning.ref_stats)
        tuning.ref_stats_plain = both("REF_STATS_PLAIN", tuning.ref_stats_plain)
        return tuning


TUNING = KernelTuning.from_env()
