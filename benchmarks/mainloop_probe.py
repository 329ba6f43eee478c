"""How far the fused forward's Triton main loop is from cuBLAS, with and without its softmax epilogue (issue 45).

The frozen head's fused forward is ~1.3x its GEMM. This splits that distance: for one [tokens, H] x [V, H]^T
logits GEMM in bf16 (V = 151,936, in 8192-token launches as the kernel runs it) it times, side by side,
  - `cublas`: torch.mm writing the bf16 logits (the floor's first GEMM);
  - `store`: the same tiles as the kernel (tensor-descriptor loads, persistent, grouped) storing bf16 logits;
  - `sums`: the same GEMM reduced to per-row max and sum of exp (no [N, V] store: the statistics forward's epilogue);
  - `p_store`: exp against a per-row reference, its row sum, and the bf16 P~ store (the frozen forward's epilogue
    without the target handling);
for each tile configuration given. `store` / `cublas` is the main loop's own distance; `p_store` / `store` what
the epilogue adds to it.

    python benchmarks/mainloop_probe.py --hidden 1024,4096 --tokens 32768 --configs 128x128x64x8x4,128x256x64x8x3
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

V = 151936
CHUNK = 8192
EPILOGUES = {"store": 0, "sums": 1, "p_store": 2}


@triton.jit
def _probe_kernel(h_desc, w_desc, z_desc, ref_ptr, part_ptr, M, N, K, EPI: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        group = GROUP_M * num_pid_n
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % size_m
        pid_n = (tile % group) // size_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            a = h_desc.load([pid_m * BM, k * BK])
            b = w_desc.load([pid_n * BN, k * BK])
            acc = tl.dot(a, b.T, acc)
        if EPI == 0:
            z_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))
        else:
            offs_m = pid_m * BM + tl.arange(0, BM)
            if EPI == 1:
                m = tl.max(acc, axis=1)
                e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [(acc - m[:, None]) * 1.4426950408889634],
                                              dtype=tl.float32, is_pure=True, pack=1)
                tl.store(part_ptr + pid_n * M + offs_m, m, mask=offs_m < M)
            else:
                ref = tl.load(ref_ptr + offs_m, mask=offs_m < M, other=0.0)
                e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [(acc - ref[:, None]) * 1.4426950408889634],
                                              dtype=tl.float32, is_pure=True, pack=1)
                z_desc.store([pid_m * BM, pid_n * BN], e.to(tl.bfloat16))
            tl.store(part_ptr + (num_pid_n + pid_n) * M + offs_m, tl.sum(e, axis=1), mask=offs_m < M)


def _config(text: str) -> tuple[int, ...]:
    """BMxBNxBKxWARPSxSTAGES → a tuple of five positive ints (an argparse type: a bad value is a one-line error)."""
    parts = text.strip().split("x")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: BMxBNxBKxWARPSxSTAGES, e.g. 128x256x64x8x3")
    return tuple(int(p) for p in parts)


def _configs(text: str) -> list[tuple[int, ...]]:
    return [_config(c) for c in text.split(",") if c.strip()]


def _hidden(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: hidden sizes, e.g. 1024,4096")
    return sizes


def probe(hidden: int, tokens: int, configs: list[tuple[int, ...]]) -> list[dict]:
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, hidden, device="cuda") * hidden ** -0.5 * 2).to(torch.bfloat16)
    z = torch.empty(CHUNK, V, device="cuda", dtype=torch.bfloat16)
    ref = torch.full((CHUNK,), 8.0, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=2, rep=400, return_mode="median")

    def cublas():
        for t0 in range(0, tokens, CHUNK):
            torch.mm(h[t0:t0 + CHUNK], w.T, out=z)

    base = timed(cublas)
    rows.append({"H": hidden, "tokens": tokens, "variant": "cublas", "config": "", "ms": base})
    for bm, bn, bk, warps, stages in configs:
        part = torch.empty(2 * triton.cdiv(V, bn) * CHUNK, device="cuda")
        w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
        z_desc = TensorDescriptor.from_tensor(z, [bm, bn])
        n_tiles = triton.cdiv(CHUNK, bm) * triton.cdiv(V, bn)
        for name, epi in EPILOGUES.items():
            def run():
                for t0 in range(0, tokens, CHUNK):
                    h_desc = TensorDescriptor.from_tensor(h[t0:t0 + CHUNK], [bm, bk])
                    _probe_kernel[(min(sms, n_tiles),)](h_desc, w_desc, z_desc, ref, part, CHUNK, V, hidden, EPI=epi,
                                                        BM=bm, BN=bn, BK=bk, GROUP_M=8, NUM_PROGRAMS=min(sms, n_tiles),
                                                        num_warps=warps, num_stages=stages)
            try:
                ms = timed(run)
            except Exception as err:  # a tile that does not fit shared memory
                print(f"probe H={hidden} {name} {bm}x{bn}x{bk}x{warps}x{stages} failed: {type(err).__name__}: "
                      f"{str(err)[:160]}", flush=True)
                ms = float("nan")
            rows.append({"H": hidden, "tokens": tokens, "variant": name,
                         "config": f"{bm}x{bn}x{bk}x{warps}x{stages}", "ms": ms})
    for r in rows:
        tflops = 2 * tokens * V * hidden / r["ms"] / 1e9
        print(f"probe H={hidden} N={tokens} {r['variant']:8s} {r['config']:18s} {r['ms']:8.2f} ms  "
              f"x{r['ms'] / base:.3f} cuBLAS  {tflops:6.0f} TFLOP/s", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=_hidden, default="1024,4096", help="hidden sizes, comma-separated (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens, in launches of 8192 (default: %(default)s)")
    p.add_argument("--configs", type=_configs, default="128x128x64x8x4,128x256x64x8x3",
                   help="BMxBNxBKxWARPSxSTAGES, comma-separated (default: %(default)s)")
    args = p.parse_args(argv)
    if args.tokens <= 0:
        p.error(f"--tokens {args.tokens}: a positive count")
    if not torch.cuda.is_available():
        print("mainloop_probe needs a CUDA GPU (Triton's interpreter runs no inline PTX)", file=sys.stderr)
        return 2
    for hidden in args.hidden:
        probe(hidden, args.tokens, args.configs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
