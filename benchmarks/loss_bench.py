"""Loss-head benchmark: naive / liger / trl / grpo_lab on the Qwen3-0.6B head, plus whole-GRPO-step peak memory.

Measures, per backend × dtype × B (512 completion tokens per sequence, H=1024, V=151936):
  - `loss_peak_gib`: torch.cuda.max_memory_allocated during one forward+backward of the GRPO loss, minus what was
    allocated before it (the inputs: hidden states and head weight) — the loss's own footprint;
  - `abs_peak_gib`: the same peak including the inputs;
  - `ms`: median wall time (CUDA events) of one forward+backward.
Log-prob backends (naive, trl, grpo_lab) feed `grpo_lab.loss.grpo_loss` (dapo, on-policy, entropy computed for
logging as TRL's trainer does); liger runs its own `LigerFusedLinearGRPOLoss` (uncompiled). TRL's head is called
with the chunk size its trainer uses (`_CHUNKED_LOGPROB_CHUNK_SIZE`, 32768). TF32 is off, so fp32 means fp32.

The step part builds a random-init Qwen3-0.6B (`grpo_lab.models.build_model`), 256 prompt + 512 completion tokens,
and records the peak of forward + backward + AdamW step for each backend.

Writes long-format CSV (`loss_bench.csv`, `step_bench.csv`) with gpu/torch/triton/trl/liger versions and the date
to --out, and prints a table. Not a test: run it on the GPU, e.g.
    python benchmarks/loss_bench.py --out results/loss_kernel
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import statistics
import sys
import time

import torch

H, V, T_COMPLETION, T_PROMPT = 1024, 151936, 512, 256
BACKENDS = ("naive", "liger", "trl", "grpo_lab")


def versions() -> dict:
    out = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    for name in ("triton", "trl", "liger_kernel", "transformers"):
        try:
            mod = __import__(name)
            out[name if name != "liger_kernel" else "liger"] = getattr(mod, "__version__", "?")
        except Exception:
            out[name if name != "liger_kernel" else "liger"] = "absent"
    if out["liger"] == "?":
        from importlib.metadata import version

        out["liger"] = version("liger-kernel")
    out["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return out


def loss_config():
    from grpo_lab.loss_config import GRPOLossConfig

    return GRPOLossConfig(loss_type="dapo", beta=0.0)


def make_loss_fn(backend: str, config):
    """fn(hidden[B,T,H], weight, ids[B,T], mask[B,T], advantages[B]) -> scalar loss."""
    from grpo_lab.loss import grpo_loss

    if backend == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        mod = LigerFusedLinearGRPOLoss(beta=config.beta, compiled=False, use_ref_model=False, loss_type="dapo",
                                       epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high_value,
                                       temperature=config.temperature)

        def fn(hidden, weight, ids, mask, adv):
            return mod(hidden, weight, ids, mask, adv)[0]

        return fn
    if backend == "trl":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk

        def head(h, w, y):
            return ChunkedLogProbFunction.apply(h, w, None, y, 1.0, chunk, None, 1.0, ("log_probs", "entropy"))
    else:
        from grpo_lab.backends import get_logprob_backend

        impl = get_logprob_backend(backend)

        def head(h, w, y):
            return impl(h, w, None, y, 1.0, None, None, 1.0, ("log_probs", "entropy"))

    def fn(hidden, weight, ids, mask, adv):
        b, t, _ = hidden.shape
        lp, ent, *_ = head(hidden.reshape(-1, H), weight, ids.reshape(-1))
        lp = lp.view(b, t)
        ent = ent.view(b, t).detach()
        return grpo_loss(lp, mask, adv, config, entropies=ent, num_items_in_batch=mask.sum()).loss

    return fn


def cuda_time(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench_loss_point(backend, dtype, b, config, budget_s=2.5):
    gen = torch.Generator(device="cuda").manual_seed(b)
    hidden = (torch.randn(b, T_COMPLETION, H, device="cuda", generator=gen)).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * H ** -0.5 * 2).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (b, T_COMPLETION), device="cuda", generator=gen)
    mask = torch.ones(b, T_COMPLETION, device="cuda", dtype=torch.long)
    adv = torch.randn(b, device="cuda", generator=gen)
    fn = make_loss_fn(backend, config)

    def step():
        hidden.grad = None
        weight.grad = None
        fn(hidden, weight, ids, mask, adv).backward()

    step()  # warm-up: compilation, cuBLAS handles
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    first = cuda_time(step, 1)[0]
    peak = torch.cuda.max_memory_allocated()
    reps = max(3, min(20, int(budget_s * 1000 / max(first, 1e-3))))
    times = cuda_time(step, reps)
    del hidden, weight, fn
    gc.collect()
    torch.cuda.empty_cache()
    return {"ms": statistics.median(times), "loss_peak_gib": (peak - base) / 2**30, "abs_peak_gib": peak / 2**30,
            "reps": reps}


def bench_step_point(model, backend, dtype, b, config):
    """Peak memory of forward + backward + AdamW step of the whole model with `backend` as the loss head."""
    fn = make_loss_fn(backend, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False)
    gen = torch.Generator(device="cuda").manual_seed(b)
    ids = torch.randint(0, V, (b, T_PROMPT + T_COMPLETION), device="cuda", generator=gen)
    mask = torch.ones(b, T_COMPLETION, device="cuda", dtype=torch.long)
    adv = torch.randn(b, device="cuda", generator=gen)
    weight = model.lm_head.weight

    def step():
        out = model.model(input_ids=ids)
        hidden = out.last_hidden_state[:, T_PROMPT - 1:-1]
        fn(hidden, weight, ids[:, T_PROMPT:], mask, adv).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    ok = True
    try:
        step()
        step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        ok = False
    dt = (time.perf_counter() - t0) / 2
    peak = torch.cuda.max_memory_allocated()
    opt.zero_grad(set_to_none=True)
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    return {"step_peak_gib": peak / 2**30 if ok else float("nan"), "step_s": dt if ok else float("nan")}


def write_csv(path, rows):
    if not rows:
        return
    keys = list(rows[0].keys())
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/loss_kernel")
    p.add_argument("--batches", default="4,8,16,32,64")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--step-batches", default="8,16,32", help="B for the whole-step memory ('' to skip)")
    p.add_argument("--step-dtypes", default="bf16")
    p.add_argument("--budget-s", type=float, default=1.5, help="timing budget per point")
    p.add_argument("--tune", action="store_true", help="only the tile-config sweep of the grpo_lab head")
    p.add_argument("--autotune", action="store_true", help="sweep grpo_lab settings first, bench with the best")
    p.add_argument("--tune-no-refs", action="store_true", help="skip the cuBLAS floor and TRL in --tune")
    args = p.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    meta = versions()
    os.makedirs(args.out, exist_ok=True)
    if args.tune:
        return tune(args.out, refs=not args.tune_no_refs)
    if args.autotune:
        autotune(args.out)
    import grpo_lab.kernels.fused_linear_logprob as F

    meta["grpo_lab_setting"] = kernel_setting(F)
    config = loss_config()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for dname in args.dtypes.split(","):
        for backend in args.backends.split(","):
            for b in map(int, args.batches.split(",")):
                r = bench_loss_point(backend, dtypes[dname], b, config, args.budget_s)
                row = {"part": "loss", "backend": backend, "dtype": dname, "B": b, "tokens": b * T_COMPLETION,
                       "H": H, "V": V, **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                       **meta}
                rows.append(row)
                print(f"loss {dname:5s} {backend:9s} B={b:3d} {r['ms']:9.2f} ms  loss_peak {r['loss_peak_gib']:.3f} "
                      f"GiB  abs {r['abs_peak_gib']:.3f} GiB", flush=True)
                write_csv(os.path.join(args.out, "loss_bench.csv"), rows)

    step_rows = []
    if args.step_batches:
        from grpo_lab.models import build_model

        for dname in args.step_dtypes.split(","):
            model = build_model("Qwen3-0.6B", dtypes[dname], device="cuda")
            model.train()
            for backend in args.backends.split(","):
                for b in map(int, args.step_batches.split(",")):
                    r = bench_step_point(model, backend, dtypes[dname], b, config)
                    step_rows.append({"part": "step", "backend": backend, "dtype": dname, "B": b,
                                      "prompt_tokens": T_PROMPT, "completion_tokens": T_COMPLETION,
                                      "model": "Qwen3-0.6B (random init)",
                                      **{k: round(v, 4) for k, v in r.items()}, **meta})
                    print(f"step {dname:5s} {backend:9s} B={b:3d} peak {r['step_peak_gib']:.2f} GiB "
                          f"{r['step_s']:.2f} s/step", flush=True)
                    write_csv(os.path.join(args.out, "step_bench.csv"), step_rows)
            del model
            gc.collect()
            torch.cuda.empty_cache()

    print("\n" + format_table(rows, step_rows, meta))


TUNE_EXPERIMENTS = {
    # Relative to the defaults (TMA loads, persistent 16-bit kernels, dZ 16384 x 8192 for 16-bit). Runs 2 and 3
    # measured earlier lists (tune_run2.csv, tune_run3.csv; their labels use that time's knob names).
    "bf16": [
        {},
        {"persistent": False},
        {"dz_tma": True},
        {"bwd_tile": (8192, 8192)},
        {"cfg": (128, 256, 64, 8, 8, 4)},
    ],
    "fp32": [
        {},
        {"persistent": True},
    ],
}
# Every knob an experiment sets belongs to its own dtype, so `autotune` cannot carry bf16's choice into fp32.
FP32_ONLY = ("mm", "FP32_MM", "FP32_DOT")


def apply_experiment(F, exp, dname):
    key = "16" if dname == "bf16" else "32"
    for k, v in exp.items():
        if k in FP32_ONLY and dname != "fp32":
            raise ValueError(f"{k} is an fp32 knob; a {dname} experiment cannot set it")
        if k == "cfg":
            F.CONFIGS[f"fwd_{key}"] = F.CONFIGS[f"bwd_{key}"] = v
        elif k == "mm":
            F.CONFIGS["mm_32"] = v
        elif k in ("FP32_MM", "FP32_DOT"):
            setattr(F, k, v)
        elif k == "bwd_tile":
            F.BWD_TILE[key] = v
        elif k == "dz_tma":
            F.DZ_TMA[key] = v
        elif k == "persistent":
            F.PERSISTENT[f"fwd_{key}"] = F.PERSISTENT[f"bwd_{key}"] = v
        else:
            raise ValueError(f"unknown tuning knob {k!r}")


def kernel_setting(F) -> str:
    """The kernel knobs in force, for the CSV's `grpo_lab_setting` column."""
    on = [k for k, v in F.PERSISTENT.items() if v]
    tiles = " ".join(f"{k}:{t}x{v}" for k, (t, v) in F.BWD_TILE.items())
    dz = [k for k, v in F.DZ_TMA.items() if v]
    return (f"TMA loads {'on' if F.USE_TMA else 'off'}; persistent {','.join(on) or 'none'}; dZ tile {tiles}; "
            f"dZ descriptor store {','.join(dz) or 'off'}; fp32 dot {F.FP32_DOT}, fp32 dX/dW {F.FP32_MM}")


def tune(out_dir, refs=True):
    """Tile-config sweep of the grpo_lab head at B=64 (head only, no loss), against TRL's head and a cuBLAS floor."""
    import triton.testing as tt

    import grpo_lab.kernels.fused_linear_logprob as F
    from trl.kernels import ChunkedLogProbFunction

    rows = []
    n = 64 * T_COMPLETION
    defaults = {name: dict(getattr(F, name)) for name in ("CONFIGS", "PERSISTENT", "BWD_TILE", "DZ_TMA")}
    defaults.update({name: getattr(F, name) for name in ("FP32_MM", "FP32_DOT")})

    def restore():
        for name, value in defaults.items():
            if isinstance(value, dict):
                getattr(F, name).update(value)
            else:
                setattr(F, name, value)

    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(n, H, device="cuda", generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=gen) * H ** -0.5 * 2).to(dtype).requires_grad_()
        y = torch.randint(0, V, (n,), device="cuda", generator=gen)
        g = torch.randn(n, device="cuda", generator=gen)
        # cuBLAS floor: the 4 GEMMs on [4096, 4096] tiles, no elementwise work
        a = h.detach()[:4096] if refs else None
        wt = w.detach()
        buf = torch.empty(4096, 4096, device="cuda", dtype=dtype)
        acc_h = torch.zeros(4096, H, device="cuda")
        acc_w = torch.zeros(4096, H, device="cuda")

        def floor():
            for v0 in range(0, V - 4096 + 1, 4096):
                torch.mm(a, wt[v0:v0 + 4096].t(), out=buf)
                torch.mm(a, wt[v0:v0 + 4096].t(), out=buf)
                F._mm_acc(acc_h, buf, wt[v0:v0 + 4096])
                F._mm_acc(acc_w, buf.t(), a)
        tiles = (V // 4096) * (n // 4096)
        ms = float("nan") if not refs else tt.do_bench(floor, warmup=50, rep=300, return_mode="median") * (n // 4096) * V / (4096 * (V // 4096))
        rows.append({"dtype": dname, "what": "cublas_4gemm_floor", "config": "4096x4096 tiles", "ms": ms,
                     "fwd_ms": float("nan")})
        print(f"tune {dname} cublas 4-GEMM floor {ms:.1f} ms ({tiles} tiles)", flush=True)
        del buf, acc_h, acc_w

        def head(kind):
            if kind == "trl":
                return lambda: ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 32768, None, 1.0, ("entropy",))
            return lambda: F.fused_linear_logprobs(h, w, None, y, 1.0, None, None, 1.0, ("entropy",))

        def fwd_bwd(kind):
            f = head(kind)

            def run():
                h.grad = w.grad = None
                (f()[0] * g).sum().backward()
            return run

        for kind in ("trl",) if refs else ():
            with torch.no_grad():
                t_f = tt.do_bench(head(kind), warmup=1, rep=20 if dname == "bf16" else 1, return_mode="median")
            t_fb = tt.do_bench(fwd_bwd(kind), warmup=1, rep=300 if dname == "bf16" else 1,
                               return_mode="median")
            rows.append({"dtype": dname, "what": "trl_head", "config": "chunk 32768", "ms": t_fb, "fwd_ms": t_f})
            print(f"tune {dname} trl head fwd {t_f:.1f} fwd+bwd {t_fb:.1f} ms", flush=True)
        for exp in TUNE_EXPERIMENTS[dname]:
            apply_experiment(F, exp, dname)
            label = " ".join(f"{k}={v}" for k, v in exp.items()) or "default"
            try:
                with torch.no_grad():
                    t_f = tt.do_bench(head("mine"), warmup=1, rep=20 if dname == "bf16" else 1,
                                      return_mode="median")
                t_fb = tt.do_bench(fwd_bwd("mine"), warmup=1, rep=300 if dname == "bf16" else 1,
                                   return_mode="median")
            except Exception as err:  # a config that does not compile or fit
                print(f"tune {dname} {label} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
                t_f = t_fb = float("nan")
            finally:
                restore()
            rows.append({"dtype": dname, "what": "grpo_lab_head", "config": label, "ms": t_fb, "fwd_ms": t_f,
                         "exp": exp})
            print(f"tune {dname} grpo_lab {label}: fwd {t_f:.1f} fwd+bwd {t_fb:.1f} ms", flush=True)
        del h, w
        gc.collect()
        torch.cuda.empty_cache()
    write_csv(os.path.join(out_dir, "tune.csv"), [{k: v for k, v in r.items() if k != "exp"} for r in rows])
    return rows


def autotune(out_dir):
    """Run the sweep, then keep the fastest fwd+bwd setting of each dtype for the rest of this process."""
    import math

    import grpo_lab.kernels.fused_linear_logprob as F

    rows = tune(out_dir, refs=False)
    chosen = {}
    for dname in ("bf16", "fp32"):
        cands = [r for r in rows if r["dtype"] == dname and "exp" in r and not math.isnan(r["ms"])]
        if cands:
            best = min(cands, key=lambda r: r["ms"])
            chosen[dname] = best["config"]
            apply_experiment(F, best["exp"], dname)
    print(f"autotune chose {chosen}", flush=True)
    return chosen


def format_table(rows, step_rows, meta):
    lines = [f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, trl {meta['trl']}, "
             f"liger {meta['liger']}, {meta['date']}", "",
             "Loss fwd+bwd: ms / loss peak GiB (over inputs)", ""]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for dname in dict.fromkeys(r["dtype"] for r in rows):
        lines.append(f"| {dname} B | " + " | ".join(backends) + " |")
        lines.append("|---" * (len(backends) + 1) + "|")
        for b in dict.fromkeys(r["B"] for r in rows):
            cells = []
            for be in backends:
                m = [r for r in rows if r["dtype"] == dname and r["B"] == b and r["backend"] == be]
                cells.append(f"{m[0]['ms']:.1f} / {m[0]['loss_peak_gib']:.2f}" if m else "-")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    if step_rows:
        lines.append("Whole GRPO step (fwd+bwd+AdamW) peak GiB, Qwen3-0.6B random init, 256+512 tokens")
        sb = list(dict.fromkeys(r["backend"] for r in step_rows))
        lines.append("| dtype B | " + " | ".join(sb) + " |")
        lines.append("|---" * (len(sb) + 1) + "|")
        for dname in dict.fromkeys(r["dtype"] for r in step_rows):
            for b in dict.fromkeys(r["B"] for r in step_rows):
                cells = []
                for be in sb:
                    m = [r for r in step_rows if r["dtype"] == dname and r["B"] == b and r["backend"] == be]
                    cells.append(f"{m[0]['step_peak_gib']:.2f}" if m else "-")
                lines.append(f"| {dname} {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
