"""The CUTLASS frozen-head forward against cuBLAS and the Triton frozen forward (H200; prints figures, writes a CSV).

1. exactness of each variant on ragged shapes against a float64 reference (P~ and both row sums);
2. one [8192 tokens, 8192 vocabulary] block: CUTLASS GEMM + epilogue against cuBLAS's bare GEMM (bf16 and fp32 out);
3. the whole frozen forward at 32768 tokens × 151,936 vocabulary: CUTLASS + cuBLAS P~·W against the Triton path.

    python benchmarks/cutlass_frozen_bench.py --variants all --hidden 1024,4096 --out results/loss_kernel
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
from pathlib import Path

import torch

from grpo_lab.kernels import cutlass_head
from grpo_lab.kernels.cutlass_head.build import VARIANTS

VOCAB = 151_936


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _block(rows, cols, hidden, scale, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(cols, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    z = scale * (x.double() @ w.double().T)
    ref = z.max(1).values - torch.rand(rows, device="cuda", generator=g, dtype=torch.float64) * 8
    return x, w, z, ref


def check(variant: str, rows: int, cols: int, hidden: int, scale: float = 1.3) -> dict:
    cutlass_head.VARIANT = variant
    x, w, z, ref = _block(rows, cols, hidden, scale)
    p = torch.full((rows, cols + 24), float("nan"), device="cuda", dtype=torch.bfloat16)  # ld != cols
    sums = cutlass_head.frozen_logits_exp(x, w, (-ref).float(), p, scale, True).double().sum(1)[:, :rows]
    e = torch.exp(z - ref[:, None])
    got = p[:, :cols].double()
    p_err = ((got - e).abs() / e.clamp_min(1e-30)).max().item()
    se, sez = sums
    se_err = ((se - e.sum(1)) / e.sum(1)).abs().max().item()
    ez = (e * (z - ref[:, None])).sum(1)
    sez_err = ((sez - ez).abs() / e.sum(1)).max().item()
    untouched = torch.isnan(p[:, cols:].float()).all().item()
    return dict(variant=variant, rows=rows, cols=cols, hidden=hidden, p_rel_err=p_err, sum_rel_err=se_err,
                sum_ez_err=sez_err, ld_respected=untouched)


def block_timing(variant: str, hidden: int, reps: int, rows: int = 8192, cols: int = 8192) -> dict:
    cutlass_head.VARIANT = variant
    x, w, _, ref = _block(rows, cols, hidden, 1.0)
    neg_ref = (-ref).float()
    p = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    flop = 2 * rows * cols * hidden
    ms = _time(lambda: cutlass_head.frozen_logits_exp(x, w, neg_ref, p, 1.0, True), reps)
    ms_plain = _time(lambda: cutlass_head.frozen_logits_exp(x, w, neg_ref, p, 1.0, False), reps)
    cub = _time(lambda: torch.mm(x, w.T, out=p), reps)
    out32 = torch.empty(rows, cols, device="cuda")
    cub32 = _time(lambda: torch.mm(x, w.T, out_dtype=torch.float32, out=out32), reps)
    return dict(variant=variant, hidden=hidden, rows=rows, cols=cols, cutlass_ms=ms, cutlass_no_ez_ms=ms_plain,
                cublas_bf16_ms=cub, cublas_fp32_ms=cub32, cutlass_tflops=flop / ms / 1e9,
                cublas_tflops=flop / cub / 1e9)


def whole_forward(variant: str, hidden: int, tokens: int, reps: int) -> dict:
    """GEMM1 + epilogue (CUTLASS) and P~·W (cuBLAS, fp32 accumulation) over the whole vocabulary, 8192² blocks, against
    the Triton frozen forward of the same rows (`_frozen_forward`, statistics + A)."""
    from grpo_lab.kernels.fused_linear_logprob import _frozen_forward, _mm_acc

    cutlass_head.VARIANT = variant
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(VOCAB, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    y = torch.randint(0, VOCAB, (tokens,), device="cuda", generator=g)
    neg_ref = -(x.float() * w[y].float()).sum(1)
    t_tile, v_tile = 8192, 8192
    buf = torch.empty(t_tile, v_tile, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(tokens, hidden, device="cuda")
    run = torch.zeros(2, tokens, device="cuda")

    def cutlass_forward():
        for t0 in range(0, tokens, t_tile):
            t1 = min(tokens, t0 + t_tile)
            for v0 in range(0, VOCAB, v_tile):
                v1 = min(VOCAB, v0 + v_tile)
                p = buf[: t1 - t0, : v1 - v0]
                sums = cutlass_head.frozen_logits_exp(x[t0:t1], w[v0:v1], neg_ref[t0:t1], p, 1.0, True)
                run[:, t0:t1] += sums.sum(1)[:, : t1 - t0]
                _mm_acc(acc[t0:t1], p, w[v0:v1])

    want = {"entropy": True, "log_sum_sq_probs": False, "mean_logits": False, "is_top1": False}
    triton_ms = _time(lambda: _frozen_forward(x, w, None, y, 1.0, None, 1.0, torch.bfloat16, want, False), reps)
    cutlass_ms = _time(cutlass_forward, reps)
    gemm1 = _time(lambda: [torch.mm(x[t0:t0 + t_tile], w[v0:v0 + v_tile].T, out=buf[: min(t_tile, tokens - t0),
                                                                                     : min(v_tile, VOCAB - v0)])
                           for t0 in range(0, tokens, t_tile) for v0 in range(0, VOCAB, v_tile)], reps)
    return dict(variant=variant, hidden=hidden, tokens=tokens, triton_frozen_forward_ms=triton_ms,
                cutlass_plus_cublas_ms=cutlass_ms, cublas_gemm1_only_ms=gemm1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="all")
    parser.add_argument("--hidden", default="1024,4096")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    variants = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    hiddens = [int(h) for h in args.hidden.split(",")]
    machine = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node())
    rows = []
    for v in variants:
        for shape in ((300, 1000, 1024), (129, 8192, 4096), (4096, 40, 1024)):
            r = check(v, *shape)
            print("check", r, flush=True)
            rows.append(dict(kind="check", **r))
    for h in hiddens:
        for v in variants:
            r = block_timing(v, h, args.reps)
            print("block", {k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()}, flush=True)
            rows.append(dict(kind="block", **r))
    best = min((r for r in rows if r["kind"] == "block" and r["hidden"] == hiddens[0]), key=lambda r: r["cutlass_ms"])
    for h in hiddens:
        r = whole_forward(best["variant"], h, args.tokens, max(3, args.reps // 3))
        print("forward", {k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()}, flush=True)
        rows.append(dict(kind="forward", **r))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        keys = sorted({k for r in rows for k in r})
        with open(args.out / "cutlass_frozen.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys + list(machine))
            writer.writeheader()
            for r in rows:
                writer.writerow({**r, **machine})


if __name__ == "__main__":
    main()
