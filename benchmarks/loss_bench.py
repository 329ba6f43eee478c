"""Loss-head benchmark: naive / trl / grpo_lab / grpo_lab+free / liger over a grid of head shapes, both head modes.

One forward+backward of the GRPO loss (dapo, on-policy, entropy computed for logging as TRL's trainer does) on a
head of V = 151,936 (Qwen3), for every point of a grid:
  - H (hidden size) x tokens (N = B x 512 completion tokens), bf16 and fp32 (TF32 off, so fp32 means fp32);
  - head `trainable` (the weight needs a gradient: full fine-tuning) or `frozen` (it does not: PEFT / LoRA, FSDP2 +
    LoRA); the inputs always need one.
Backends: `naive` (full [N, V] logits, plain autograd), `trl` (TRL 1.16's `ChunkedLogProbFunction` with its
trainer's chunk, 32768), `grpo_lab` (this project's kernel with its defaults: a trainable head keeps its [N, V]
probabilities only under the peak the run has already reached, so in this harness, where the head is the whole step,
it runs memory-flat), `grpo_lab+free` (the policy's peak rule off, `materialize_within_peak` = False: the buffer is
kept when it fits half the free memory, the default before issue 45), `grpo_lab+flat` (the policy off,
`materialize_fraction` = 0; not run by default: here it equals `grpo_lab`), `grpo_lab+mem` (an explicit allowance,
`materialize_gib` = 48, as runs 5-10 measured; not run by default), `liger` (Liger-Kernel's `LigerFusedLinearGRPOLoss`, uncompiled, on a subset
of the grid: it is 10-30x slower). The `+` variants run only where they change the path (a trainable head). Log-prob
backends feed `grpo_lab.loss.grpo_loss`.

Per point: `ms` (median CUDA-event time of one fwd+bwd after a warm-up; `ms_min` / `ms_max` its spread over the
reps), `loss_peak_gib` (peak allocated during it minus what was allocated before: hidden states + weight),
`abs_peak_gib`, `reps`, `status` (`ok`, `oom`), and the distance to the machine: `floor_ms`, the cuBLAS GEMMs an exact
head of that shape must do, measured in the same process on the same inputs (`gemm_floor`: 2 GEMMs for a frozen head,
N×H·(V×H)ᵀ and its N×V·V×H, 3 for a trainable one, + the V×N·N×H weight gradient; `floor_gemms`, and each GEMM's
own ms in `gemm_logits`, `gemm_dx`, `gemm_dw`) and `floor_ratio` = ms / floor_ms. The
`paths` column says which kernel paths a grpo_lab row ran
(`grpo_lab.loss.kernel.path_counts()` over its calls). The `accuracy` part measures, at N = 2048, the relative error of the log-probs, the entropy and the gradients against a
float64 reference. Every row carries the GPU, torch / triton / trl / liger / transformers versions, the kernel
settings and the date. Output: long-format CSVs in --out (`loss_grid.csv`, `loss_accuracy.csv`, `tune.csv`).

    python benchmarks/loss_bench.py --out results/loss_kernel            # the grid (GPU)
    python benchmarks/loss_bench.py --tune --out DIR                     # tile sweep of the grpo_lab head
    python benchmarks/loss_bench.py --report results/loss_kernel         # tables + figure from the CSVs (any machine)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

V, T_COMPLETION = 151936, 512
GRID_H = (1024, 1536, 2048, 4096, 5120)
GRID_TOKENS = (2048, 4096, 8192, 16384, 32768, 65536)
BACKENDS = ("naive", "trl", "grpo_lab", "grpo_lab+free", "grpo_lab+flat", "grpo_lab+mem", "liger")
DEFAULT_BACKENDS = ("naive", "trl", "grpo_lab", "grpo_lab+free", "liger")
REPORT_BACKENDS = ("naive", "trl", "grpo_lab", "grpo_lab+free", "grpo_lab+flat", "liger")
# the memory-policy fields each `grpo_lab+…` backend sets for its measurements (`backend_settings`)
POLICY_OF = {"grpo_lab+flat": {"materialize_fraction": 0.0, "materialize_gib": None},
             "grpo_lab+free": {"materialize_within_peak": False, "materialize_gib": None},
             "grpo_lab+mem": {"materialize_gib": 48.0}}
# The issue's seven measurements (issue 18): head, dtype, H, tokens, T (tokens per sequence).
ISSUE_ROWS = (
    ("frozen", "bf16", 1024, 32768, 512),
    ("frozen", "bf16", 4096, 8192, 512),
    ("trainable", "bf16", 1024, 32768, 512),
    ("trainable", "bf16", 1536, 32768, 4096),
    ("trainable", "bf16", 4096, 16384, 512),
    ("trainable", "fp32", 1024, 32768, 512),
    ("trainable", "fp32", 1024, 2048, 512),
)
# Issue 33's named shapes (after the seven above in a run, so a run cut by --max-minutes keeps them): the trainable
# head where the flat path lost to naive / TRL (bf16 H = 1536-2048 at 4k-64k tokens, fp32 H >= 4096).
ISSUE33_ROWS = tuple(("trainable", "bf16", hdim, tokens, 512) for hdim in (1536, 2048)
                     for tokens in (4096, 8192, 16384, 32768, 65536)) + tuple(
    ("trainable", "fp32", hdim, tokens, 512) for hdim in (4096, 5120) for tokens in (2048, 8192))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def versions() -> dict:
    """The columns every row carries: the card, the versions and the date (`grpo_lab.lab.records`, as every results
    CSV), under the names the earlier runs' CSVs use."""
    from grpo_lab.lab.records import run_record

    record = run_record("cuda" if torch.cuda.is_available() else "cpu")
    out = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    for key, column in (("triton", "triton"), ("trl", "trl"), ("liger", "liger_kernel"),
                        ("transformers", "transformers")):
        out[key] = record.get(column) or "absent"
    out["host"], out["date"] = record["host"], record["date"]
    return out


def dapo_config():
    from grpo_lab.loss.config import GRPOLossConfig

    return GRPOLossConfig(loss_type="dapo", beta=0.0)


@contextlib.contextmanager
def backend_settings(backend: str):
    """The kernel's memory policy for the duration: the fields `POLICY_OF[backend]` names (`grpo_lab+flat` off,
    `grpo_lab+free` without its peak rule, `grpo_lab+mem` an explicit allowance), `grpo_lab` as configured (the
    defaults unless GRPO_LAB_* say otherwise)."""
    if backend not in POLICY_OF or not torch.cuda.is_available():
        yield
        return
    from grpo_lab.loss.kernel.tuning import TUNING

    before = {name: getattr(TUNING, name) for name in POLICY_OF[backend]}
    for name, value in POLICY_OF[backend].items():
        setattr(TUNING, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(TUNING, name, value)


def make_loss_fn(backend: str, config):
    """fn(hidden[B,T,H], weight, ids[B,T], mask[B,T], advantages[B]) -> scalar loss."""
    from grpo_lab.loss.reference import grpo_loss

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
        from grpo_lab.loss.heads import logprob_head

        impl = logprob_head("grpo_lab" if backend.startswith("grpo_lab") else backend)

        def head(h, w, y):
            return impl(h, w, None, y, 1.0, None, None, 1.0, ("log_probs", "entropy"))

    def fn(hidden, weight, ids, mask, adv):
        b, t, hdim = hidden.shape
        lp, ent, *_ = head(hidden.reshape(-1, hdim), weight, ids.reshape(-1))
        lp = lp.view(b, t)
        ent = ent.view(b, t).detach()
        return grpo_loss(lp, mask, adv, config, entropies=ent, num_items_in_batch=mask.sum()).loss

    return fn


def make_inputs(dtype, hdim, tokens, seq, device, seed=0):
    """Hidden states [B, T, H] (needing a gradient), the head weight [V, H], ids, mask and advantages."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b = tokens // seq
    hidden = torch.randn(b, seq, hdim, device=device, generator=gen).to(dtype)
    weight = (torch.randn(V, hdim, device=device, generator=gen) * hdim ** -0.5 * 2).to(dtype)
    ids = torch.randint(0, V, (b, seq), device=device, generator=gen)
    mask = torch.ones(b, seq, device=device, dtype=torch.long)
    adv = torch.randn(b, device=device, generator=gen)
    return hidden, weight, ids, mask, adv


def timer(fn, reps: int, device) -> list[float]:
    """Milliseconds of each of `reps` calls: CUDA events on a GPU, the wall clock elsewhere."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return times


FLOOR_ROWS = 8192  # rows per cuBLAS call of the floor: [8192, V] products, as wide as cuBLAS runs at full rate


def gemm_floor(hidden, weight, reps: int, device) -> dict:
    """The cuBLAS floor of a head of this shape and dtype, measured here: the GEMMs any exact head must do, with no
    softmax work between them. Per token chunk of FLOOR_ROWS: Z = X·Wᵀ ([rows, V], the input dtype), X̄ = Z·W (fp32
    out, as every head accumulates dX) and W̄ = Zᵀ·X ([V, H]). Returns the median ms of each GEMM over all chunks;
    a frozen head's floor is the first two (`floor_ms(head)`), a trainable head's all three."""
    x = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    rows = min(x.shape[0], FLOOR_ROWS)
    z = torch.empty((rows, w.shape[0]), device=x.device, dtype=x.dtype)
    dx = torch.empty((rows, w.shape[1]), device=x.device, dtype=torch.float32)
    dw = torch.empty_like(w)
    chunks = [(r0, min(r0 + rows, x.shape[0])) for r0 in range(0, x.shape[0], rows)]

    def logits():
        for r0, r1 in chunks:
            torch.mm(x[r0:r1], w.t(), out=z[: r1 - r0])

    def input_grad():
        for r0, r1 in chunks:
            if x.dtype == torch.float32:
                torch.mm(z[: r1 - r0], w, out=dx[: r1 - r0])
            else:
                torch.mm(z[: r1 - r0], w, out_dtype=torch.float32, out=dx[: r1 - r0])

    def weight_grad():
        for r0, r1 in chunks:
            torch.mm(z[: r1 - r0].t(), x[r0:r1], out=dw)

    out = {}
    with torch.no_grad():
        for name, fn in (("gemm_logits", logits), ("gemm_dx", input_grad), ("gemm_dw", weight_grad)):
            fn()  # warm-up (cuBLAS picks its kernel); Z holds real logits from here on, never zeros
            out[name] = statistics.median(timer(fn, reps, device))
    return out


def floor_ms(floor: dict, head: str) -> tuple[float, int]:
    """(ms, GEMMs) of a head's floor: 2 GEMMs for a frozen head (logits, dX), 3 for a trainable one (+ dW)."""
    if head == "frozen":
        return floor["gemm_logits"] + floor["gemm_dx"], 2
    return floor["gemm_logits"] + floor["gemm_dx"] + floor["gemm_dw"], 3


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_point(backend, head, data, config, budget_s, device) -> dict:
    """One (backend, head mode) on prepared inputs: median ms and peak memory of one loss fwd+bwd."""
    hidden, weight, ids, mask, adv = data
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_(head == "trainable")
    fn = make_loss_fn(backend, config)

    def step():
        hidden.grad = weight.grad = None
        fn(hidden, weight, ids, mask, adv).backward()

    cuda = device.type == "cuda"
    counted = cuda and backend.startswith("grpo_lab")
    if counted:
        from grpo_lab.loss.kernel import path_counts, reset_path_counts

        reset_path_counts()
    try:
        with backend_settings(backend):
            step()  # warm-up: compilation, cuBLAS handles
            hidden.grad = weight.grad = None
            base = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            first = timer(step, 1, device)[0]
            peak = torch.cuda.max_memory_allocated() if cuda else 0
            reps = max(2 if first > 500 else 3, min(10, int(budget_s * 1000 / max(first, 1e-3))))
            times = timer(step, reps, device)
    except torch.OutOfMemoryError:
        hidden.grad = weight.grad = None
        _free(device)
        return {"ms": float("nan"), "ms_min": float("nan"), "ms_max": float("nan"), "loss_peak_gib": float("nan"),
                "abs_peak_gib": float("nan"), "reps": 0, "status": "oom", "paths": ""}
    hidden.grad = weight.grad = None
    paths = ""
    if counted:
        paths = " ".join(f"{k}:{v}" for k, v in dataclasses.asdict(path_counts()).items() if v)
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "loss_peak_gib": (peak - base) / 2**30, "abs_peak_gib": peak / 2**30, "reps": reps, "status": "ok",
            "paths": paths}


def changes_path(backend: str, head: str) -> bool:
    """The `grpo_lab+…` variants only differ from `grpo_lab` for a trainable head (a frozen one never keeps [N, V])."""
    return backend not in POLICY_OF or head == "trainable"


def liger_point(dname, hdim, tokens) -> bool:
    """The subset of the grid Liger runs on (it is 10-30x slower than the others)."""
    return (hdim, tokens) in ((1024, 2048), (1024, 8192), (4096, 2048)) and (dname == "bf16" or tokens == 2048)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_points(text: str):
    """`head:dtype:H:tokens[:T]`, comma-separated, e.g. `frozen:bf16:1024:2048,trainable:fp32:4096:8192`."""
    pts = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (4, 5) or parts[0] not in ("frozen", "trainable") or parts[1] not in DTYPES:
            raise ValueError(f"bad point {item!r}: expected head:dtype:H:tokens[:T]")
        pts.append((parts[0], parts[1], int(parts[2]), int(parts[3]), int(parts[4]) if len(parts) == 5 else
                    T_COMPLETION))
    return pts


def grid_points(args):
    """(head, dtype, H, tokens, T) in the order run: the issue's rows, then the grid from the cheapest point up (so
    a run cut by --max-minutes loses the costliest points); or exactly --points."""
    if getattr(args, "points", None):
        return parse_points(args.points)
    pts = list(dict.fromkeys(ISSUE_ROWS + ISSUE33_ROWS)) if args.issue_rows else []
    grid = []
    hs = _ints(args.hidden) if args.hidden else list(GRID_H)
    toks = _ints(args.tokens) if args.tokens else list(GRID_TOKENS)
    for dname in args.dtypes.split(","):
        for hdim in hs:
            for tokens in toks:
                if dname == "fp32" and not fp32_point(hdim, tokens, args.fp32_full):
                    continue
                for head in ("frozen", "trainable"):
                    pt = (head, dname, hdim, tokens, T_COMPLETION)
                    if pt not in pts:
                        grid.append(pt)
    # fp32 runs plain SGEMM: ~13x the bf16 time per FLOP; points sharing inputs stay together
    return pts + sorted(grid, key=lambda p: (p[2] * p[3] * (13 if p[1] == "fp32" else 1), p[1], p[2], p[3]))


def fp32_point(hdim, tokens, full) -> bool:
    """fp32 runs plain SGEMM (~50 TFLOP/s, 15x slower than bf16): the grid's fp32 part is a subset unless --fp32-full."""
    return full or tokens in (2048, 8192) or (hdim == 1024 and tokens == 32768)


def run_grid(args, meta, device, setting):
    config = dapo_config()
    backends = args.backends.split(",")
    rows, deadline = [], time.time() + args.max_minutes * 60
    path = os.path.join(args.out, "loss_grid.csv")
    data_key, data = None, None
    for head, dname, hdim, tokens, seq in grid_points(args):
        if time.time() > deadline:
            print(f"time budget of {args.max_minutes} min spent: stopping before {head} {dname} H={hdim} "
                  f"N={tokens}", flush=True)
            break
        if data_key != (dname, hdim, tokens, seq):
            data = None
            _free(device)
            data = make_inputs(DTYPES[dname], hdim, tokens, seq, device, seed=hdim + tokens)
            data_key = (dname, hdim, tokens, seq)
        floors = {}  # per repeat, measured just before it: the card's clocks drift over minutes of load
        for repeat, backend in [(i, b) for i in range(args.repeats) for b in backends]:
            if not changes_path(backend, head) or (backend == "liger" and not liger_point(dname, hdim, tokens)):
                continue
            if repeat not in floors:
                floors[repeat] = gemm_floor(data[0], data[1], args.floor_reps, device)
                _free(device)
            floor = floors[repeat]
            r = bench_point(backend, head, data, config, args.budget_s, device)
            r["repeat"] = repeat
            f_ms, f_gemms = floor_ms(floor, head)
            r.update(floor_ms=f_ms, floor_gemms=f_gemms, floor_ratio=r["ms"] / f_ms, **floor)
            row = {"part": "loss", "backend": backend, "head": head, "dtype": dname, "H": hdim, "V": V,
                   "tokens": tokens, "T": seq, "B": tokens // seq,
                   **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                   "setting": setting(backend), **meta}
            rows.append(row)
            print(f"{head:9s} {dname} H={hdim:5d} N={tokens:6d} {backend:13s} {r['ms']:10.2f} ms  "
                  f"floor {f_ms:8.2f} ({f_gemms} GEMMs) x{r['floor_ratio']:.2f}  "
                  f"loss peak {r['loss_peak_gib']:.3f} GiB  {r['status']}  {r['paths']}", flush=True)
            write_csv(path, rows)
    return rows


def profile(points, out_dir, device):
    """Where a grpo_lab fwd+bwd spends its GPU time: torch.profiler's kernel table (3 steps after a warm-up), plus the
    wall time of the same steps, into profile.txt."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    config = dapo_config()
    lines = []
    for head, dname, hdim, tokens, seq in points:
        hidden, weight, ids, mask, adv = make_inputs(DTYPES[dname], hdim, tokens, seq, device, seed=1)
        hidden.requires_grad_()
        weight.requires_grad_(head == "trainable")
        fn = make_loss_fn("grpo_lab", config)

        def step():
            hidden.grad = weight.grad = None
            fn(hidden, weight, ids, mask, adv).backward()
        cuda = device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        try:
            step()
            sync()
            with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                t0 = time.perf_counter()
                for _ in range(3):
                    step()
                sync()
                wall = (time.perf_counter() - t0) / 3 * 1000
            table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=14,
                                              max_name_column_width=60)
        except Exception as err:  # a profile is a diagnosis: never let it stop the benchmark
            wall, table = float("nan"), f"profile failed: {type(err).__name__}: {err}"
        lines += [f"== grpo_lab {head} {dname} H={hdim} N={tokens}: {wall:.2f} ms wall per step (3 steps)", table]
        print(lines[-2], flush=True)
        print("\n".join(table.splitlines()[:12]), flush=True)
        del hidden, weight
        _free(device)
    with open(os.path.join(out_dir, "profile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def accuracy_rows(args, meta, device, setting):
    """Relative errors against float64 (N = 2048 = B 4 by default): log-probs, entropy, dX and (trainable) dW."""
    config = dapo_config()
    rows = []
    for dname in args.dtypes.split(","):
        for hdim in map(int, args.accuracy_hidden.split(",")):
            hidden, weight, ids, mask, adv = make_inputs(DTYPES[dname], hdim, args.accuracy_tokens, T_COMPLETION,
                                                         device, seed=7)
            for head in ("frozen", "trainable"):
                ref = _loss_and_grads("naive", head, config, hidden.double(), weight.double(), ids, mask, adv)
                for backend in [b for b in args.backends.split(",") if b != "liger" and changes_path(b, head)]:
                    with backend_settings(backend):
                        out = _loss_and_grads(backend, head, config, hidden, weight, ids, mask, adv)
                    err = {k: _rel(out[k], ref[k]) for k in out}
                    rows.append({"part": "accuracy", "backend": backend, "head": head, "dtype": dname, "H": hdim,
                                 "V": V, "tokens": args.accuracy_tokens, **{f"err_{k}": f"{v:.3g}" for k, v in err.items()},
                                 "setting": setting(backend), **meta})
                    print(f"accuracy {head:9s} {dname} H={hdim} {backend:13s} "
                          + " ".join(f"{k} {v:.2e}" for k, v in err.items()), flush=True)
                    write_csv(os.path.join(args.out, "loss_accuracy.csv"), rows)
            del hidden, weight
            _free(device)
    return rows


def _loss_and_grads(backend, head, config, hidden, weight, ids, mask, adv):
    from grpo_lab.loss.heads import logprob_head

    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_(head == "trainable")
    loss = make_loss_fn(backend, config)(h, w, ids, mask, adv)
    loss.backward()
    with torch.no_grad():
        name = "grpo_lab" if backend.startswith("grpo_lab") else backend
        lp, ent, *_ = (logprob_head(name) if name != "trl" else _trl_head)(
            h.reshape(-1, h.shape[-1]), w, None, ids.reshape(-1), 1.0, 32768, None, 1.0, ("log_probs", "entropy"))
    # (the on-policy loss value itself is −mean(advantage) whatever the log-probs: its error says nothing)
    out = {"logprobs": lp, "entropy": ent, "dX": h.grad}
    if head == "trainable":
        out["dW"] = w.grad
    return out


def _trl_head(*args):
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(*args)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def write_csv(path, rows):
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- tuning -------------------------------------------------------------------------------------------------------

TUNE_EXPERIMENTS = {
    # Relative to the defaults (TMA loads, persistent 16-bit kernels, dZ and frozen tiles 16384 x 8192 for 16-bit).
    # Runs 2 and 3 measured earlier lists (tune_run2.csv, tune_run3.csv; their labels use that time's knob names).
    "bf16": [
        {},
        {"p_tma": True},
        {"frozen_cfg": (128, 128, 64, 8, 8, 3)},
        {"frozen_cfg": (128, 128, 64, 8, 8, 3), "p_tma": True},
        {"frozen_cfg": (128, 128, 64, 8, 8, 4), "p_tma": True},
        {"frozen_cfg": (128, 128, 64, 8, 8, 3), "p_tma": True, "frozen_tile": (8192, 16384)},
        {"p_tma": True, "frozen_tile": (8192, 16384)},
        {"frozen_cfg": (128, 128, 64, 8, 8, 3), "p_tma": True, "frozen_tile": (4096, 16384)},
        {"p_tma": True, "frozen_tile": (4096, 16384)},
        {"frozen_two_gemm": False},
    ],
    "fp32": [
        {},
        {"cfg": (128, 128, 32, 8, 4, 3)},
        {"cfg": (128, 64, 32, 8, 4, 4)},
    ],
}
# Every knob an experiment sets belongs to its own dtype, so `autotune` cannot carry bf16's choice into fp32.
FP32_ONLY = ("mm", "FP32_MM", "FP32_DOT")


# Knobs that set one entry (the experiment's dtype) of the per-dtype table of the kernel's `KernelTuning` field of
# that name, and knobs that set one of its fields outright (knob -> field).
PER_DTYPE_KNOBS = ("bwd_tile", "frozen_tile", "dz_tma", "p_tma", "frozen_recompute_below", "ref_stats",
                   "ref_stats_plain", "materialized_deferred_check")
FIELD_KNOBS = {"FP32_MM": "fp32_mm", "FP32_DOT": "fp32_dot", "frozen_two_gemm": "frozen_two_gemm",
               "materialize_gib": "materialize_gib", "materialize_fraction": "materialize_fraction",
               "target_zero_pass": "target_zero_pass", "target_logit_from_ref": "target_logit_from_ref",
               "dz_free_backward": "dz_free_backward"}


def apply_experiment(T, exp, dname):
    """Set the knobs of experiment `exp` (a {knob: value} dict of TUNE_EXPERIMENTS or --experiments) on `T`, the
    kernel's `KernelTuning` (`grpo_lab.loss.kernel.tuning.TUNING`), for the dtype `dname` only."""
    key = "16" if dname == "bf16" else "32"
    for k, v in exp.items():
        if k in FP32_ONLY and dname != "fp32":
            raise ValueError(f"{k} is an fp32 knob; a {dname} experiment cannot set it")
        if k == "cfg":
            T.configs[f"fwd_{key}"] = T.configs[f"bwd_{key}"] = v
        elif k == "mm":
            T.configs["mm_32"] = v
        elif k in PER_DTYPE_KNOBS:
            getattr(T, k)[key] = v
        elif k in FIELD_KNOBS:
            setattr(T, FIELD_KNOBS[k], v)
        elif k == "frozen_cfg":
            T.configs[f"frozen_{key}"] = v
        elif k == "persistent":
            T.persistent[f"fwd_{key}"] = T.persistent[f"bwd_{key}"] = v
        elif k in ("fwd_cfg", "bwd_cfg"):
            T.configs[f"{k[:3]}_{key}"] = v
        elif k == "programs_per_sm":  # {"frozen": 2, "bwd": 2}: programs per SM of those persistent launches
            T.programs_per_sm.update({f"{kind}_{key}": n for kind, n in v.items()})
        elif k == "launch":  # {"frozen": {"maxnreg": 128}}: extra Triton compile options of those kernels
            T.launch_options.update({f"{kind}_{key}": dict(opts) for kind, opts in v.items()})
        else:
            raise ValueError(f"unknown tuning knob {k!r}")


def kernel_setting(T) -> str:
    """The kernel knobs in force, for the CSV's `setting` column."""
    on = [k for k, v in T.persistent.items() if v]
    tiles = " ".join(f"{k}:{t}x{v}" for k, (t, v) in T.bwd_tile.items())
    frozen = " ".join(f"{k}:{t}x{v}" for k, (t, v) in T.frozen_tile.items())
    dz = [k for k, v in T.dz_tma.items() if v]
    p_desc = [k for k, v in T.p_tma.items() if v]
    cfg = " ".join(f"{k}:{'x'.join(map(str, v))}" for k, v in T.configs.items())
    return (f"TMA loads {'on' if T.use_tma else 'off'}; persistent {','.join(on) or 'none'}; dZ tile {tiles}; "
            f"frozen {'two-GEMM' if T.frozen_two_gemm else 'recompute'} tile {frozen}, P~ descriptor store "
            f"{','.join(p_desc) or 'off'}; dZ descriptor store "
            f"{','.join(dz) or 'off'}; fp32 dot {T.fp32_dot}, fp32 dX/dW {T.fp32_mm}"
            f"{f' on K-major slices of {T.fp32_mm_slice}' if T.fp32_mm == 'triton' else ''}; chunk launches "
            f"{'direct' if T.direct_launch else 'through the JIT'}; materialize "
            f"{_policy(T)}; statistics against ref "
            f"{','.join(k for k, v in T.ref_stats.items() if v) or 'off'}, statistics-only forward against ref "
            f"{','.join(k for k, v in T.ref_stats_plain.items() if v) or 'off'}; tiles {cfg}")


def _policy(T) -> str:
    """The memory policy in force, for the `setting` column."""
    if T.materialize_gib is not None:
        return f"{T.materialize_gib:g} GiB"
    if T.materialize_fraction <= 0:
        return "never"
    return (f"when under {T.materialize_fraction:g} of free memory, 16-bit from rows x H "
            f"{T.materialize_flat_below['16']}")


def compiled_summary(T, last_compiled: dict, head: str, dname: str) -> str:
    """Registers / spills / shared memory of the fused kernels the last run launched (`last_compiled`: the kernel's
    `launch.LAST_COMPILED`), and how many programs of each fit one H100/H200 SM (64K registers, 227 KiB shared
    memory): the tile sweep's occupancy column."""
    key = "16" if dname == "bf16" else "32"
    kinds = ("frozen",) if head == "frozen" else ("fwd", "bwd")
    parts = []
    for kind in kinds:
        compiled = last_compiled.get(f"{kind}_{key}")
        regs = getattr(compiled, "n_regs", None)  # None off CUDA (Triton's interpreter)
        if regs is None:
            continue
        shared = compiled.metadata.shared
        warps = T.configs[f"{kind}_{key}"][4]
        fit_regs = 65536 // max(1, regs * 32 * warps)
        fit_smem = (227 * 1024) // max(1, shared + 1024)
        parts.append(f"{kind}: {regs} regs, {compiled.n_spills} spills, {shared} B smem, {min(fit_regs, fit_smem)}/SM")
    return "; ".join(parts)


FROZEN_KNOBS = ("frozen_cfg", "frozen_tile", "p_tma", "frozen_two_gemm", "frozen_recompute_below", "ref_stats",
                "target_zero_pass")


def frozen_only(exp: dict) -> bool:
    """Whether an experiment changes only the frozen head's path (programs_per_sm / launch count when they name
    only the frozen forward), so the tile sweep need not time the trainable head under it."""
    per_kernel = ("programs_per_sm", "launch")
    return bool(exp) and all(k in FROZEN_KNOBS or (k in per_kernel and set(v) == {"frozen"}) for k, v in exp.items())


def tune(out_dir, hidden_sizes=(1024, 4096), token_counts=(32768,), heads=("frozen", "trainable"), dtypes=None,
         experiments=None):
    """Tile sweep of the grpo_lab head alone (no loss): frozen and trainable fwd+bwd for each experiment (an
    experiment that sets only frozen-head knobs is timed on the frozen head only). bf16 at `token_counts`, fp32 at
    8192 tokens. `experiments` replaces TUNE_EXPERIMENTS (the same per-dtype lists)."""
    import triton.testing as tt

    from grpo_lab.loss.kernel import fused_linear_logprobs, launch
    from grpo_lab.loss.kernel.tuning import TUNING as T

    rows = []
    saved = copy.deepcopy(T)

    def restore():
        for f in dataclasses.fields(T):
            setattr(T, f.name, copy.deepcopy(getattr(saved, f.name)))

    points = [(dname, n, hdim) for dname in (dtypes or DTYPES) for n in (token_counts if dname == "bf16" else (8192,))
              for hdim in hidden_sizes]
    for dname, n, hdim in points:
        dtype = DTYPES[dname]
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(n, hdim, device="cuda", generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(V, hdim, device="cuda", generator=gen) * hdim ** -0.5 * 2).to(dtype)
        y = torch.randint(0, V, (n,), device="cuda", generator=gen)
        g = torch.randn(n, device="cuda", generator=gen)
        for exp in (experiments or TUNE_EXPERIMENTS)[dname]:
            apply_experiment(T, exp, dname)
            label = " ".join(f"{k}={v}" for k, v in exp.items()) or "default"
            for head in heads:
                if head == "trainable" and frozen_only(exp):
                    continue
                w.requires_grad_(head == "trainable")

                def run():
                    h.grad = w.grad = None
                    (fused_linear_logprobs(h, w, None, y, 1.0, None, None, 1.0, ("entropy",))[0] * g).sum() \
                        .backward()
                try:
                    ms = tt.do_bench(run, warmup=1, rep=300 if dname == "bf16" else 1, return_mode="median")
                except Exception as err:  # a config that does not compile or fit
                    print(f"tune {dname} H={hdim} {head} {label} failed: {type(err).__name__}: "
                          f"{str(err)[:200]}", flush=True)
                    ms = float("nan")
                compiled = compiled_summary(T, launch.LAST_COMPILED, head, dname)
                launch.LAST_COMPILED.clear()
                rows.append({"dtype": dname, "H": hdim, "tokens": n, "head": head, "config": label, "ms": ms,
                             "compiled": compiled, "exp": exp})
                print(f"tune {dname} H={hdim} N={n} {head:9s} {label}: {ms:.2f} ms [{compiled}]", flush=True)
            restore()
        del h, w
        torch.cuda.empty_cache()
    write_csv(os.path.join(out_dir, "tune.csv"), [{k: v for k, v in r.items() if k != "exp"} for r in rows])
    return rows


# --- report: markdown tables and the figure, from the CSVs --------------------------------------------------------

def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def best_alternative(rows, key):
    """min(naive, trl) ms at a (head, dtype, H, tokens, T) key, over what ran."""
    alts = [_num(r["ms"]) for r in rows if _key(r) == key and r["backend"] in ("naive", "trl")]
    alts = [a for a in alts if not math.isnan(a)]
    return min(alts) if alts else float("nan")


def _key(r):
    return (r["head"], r["dtype"], int(r["H"]), int(r["tokens"]), int(r["T"]))


def backend_ms(rows, key, backend: str) -> float:
    """ms of `backend` at `key` (NaN where it did not run or ran out of memory)."""
    ms = [_num(r["ms"]) for r in rows if _key(r) == key and r["backend"] == backend]
    ms = [m for m in ms if not math.isnan(m)]
    return min(ms) if ms else float("nan")


def latest_rows(in_dir):
    """The rows of every loss_grid*.csv in `in_dir`; where several runs measured the same backend at the same point,
    the latest (by `date`) is kept."""
    import glob

    merged = {}
    for path in sorted(glob.glob(os.path.join(in_dir, "loss_grid*.csv"))):
        for r in read_csv(path):
            key = (r["backend"], *_key(r))
            if key not in merged or r["date"] >= merged[key]["date"]:
                merged[key] = r
    return list(merged.values())


def _kernel_knobs(setting: str) -> str:
    """A `setting` without its memory-policy clause: the policy's choice is in the `paths` column, and a cell is an
    older kernel's (†) only when the kernel's own knobs differ."""
    import re

    return re.sub(r"materialize [^;]*; ", "", setting)


def floor_of(rows, key) -> tuple[float, str]:
    """(ms, GEMMs) of the cuBLAS floor measured at `key` (by the run that measured it; NaN before floors were)."""
    for r in rows:
        if _key(r) == key and not math.isnan(_num(r.get("floor_ms"))):
            return _num(r["floor_ms"]), r.get("floor_gemms", "")
    return float("nan"), ""


def floor_table(rows) -> list[str]:
    """Every point with a measured floor: the floor and each backend's distance to it (ms / floor)."""
    keys = sorted({_key(r) for r in rows if not math.isnan(_num(r.get("floor_ms")))},
                  key=lambda k: (k[1], k[0], k[2], k[3]))
    if not keys:
        return []
    backends = [b for b in REPORT_BACKENDS if any(r["backend"] == b for r in rows)]
    lines = ["", "Distance to the machine: each backend's ms / the cuBLAS GEMM floor of the shape, measured in the same "
             "run (frozen: 2 GEMMs, N×H·(V×H)ᵀ and N×V·V×H; trainable: 3, + V×N·N×H):", "",
             "| case | floor ms (GEMMs) | " + " | ".join(backends) + " |", "|---" * (len(backends) + 2) + "|"]
    for key in keys:
        f_ms, gemms = floor_of(rows, key)
        cells = []
        for b in backends:
            ms = backend_ms(rows, key, b)
            cells.append("—" if math.isnan(ms) else f"{ms:.2f} ({ms / f_ms:.2f}×)")
        head, dname, hdim, tokens, seq = key
        lines.append(f"| {head}, {dname}, H={hdim}, {tokens // 1024}k tokens | {f_ms:.2f} ({gemms}) | "
                     + " | ".join(cells) + " |")
    return lines


def bar_table(in_dir) -> list[str]:
    """Issue 45's speed bar with its spread: at every point measured with repeats, grpo_lab (the defaults) / min(naive,
    trl) per repeat (each repeat against the other backends of the same repeat), and the widest rep-to-rep spread
    (ms_max − ms_min over ms) of the backends compared there. Rows of every loss_grid*.csv in `in_dir`, unmerged."""
    import glob

    rows = [r for path in sorted(glob.glob(os.path.join(in_dir, "loss_grid*.csv"))) for r in read_csv(path)
            if r.get("repeat", "") != ""]
    by_key = {}
    for r in rows:
        by_key.setdefault(_key(r), {}).setdefault(int(r["repeat"]), []).append(r)
    lines, worst = [], (0.0, None)
    for key in sorted(by_key, key=lambda k: (k[1], k[0], k[2], k[3])):
        ratios, spread = [], 0.0
        for reps in by_key[key].values():
            ms = {r["backend"]: _num(r["ms"]) for r in reps if r["status"] == "ok"}
            alt = min((ms[b] for b in ("naive", "trl") if b in ms), default=float("nan"))
            if "grpo_lab" in ms and not math.isnan(alt):
                ratios.append(ms["grpo_lab"] / alt)
            for r in reps:
                if r["status"] == "ok" and r["backend"] in ("naive", "trl", "grpo_lab"):
                    spread = max(spread, (_num(r["ms_max"]) - _num(r["ms_min"])) / _num(r["ms"]))
        if not ratios:
            continue
        head, dname, hdim, tokens, _ = key
        lines.append(f"| {head}, {dname}, H={hdim}, {tokens // 1024}k | {len(ratios)} | {min(ratios):.3f} | "
                     f"{max(ratios):.3f} | {spread:.1%} |")
        worst = max(worst, (max(ratios), key))
    if not lines:
        return []
    return (["", "grpo_lab (defaults) / min(naive, trl) per repeat, and the widest rep-to-rep spread of the backends "
             "there (issue 45: no cell above 1.02):", "", "| case | repeats | best | worst | spread |",
             "|---|---|---|---|---|"] + lines
            + ["", f"Worst cell: {worst[0]:.3f} at {worst[1][0]}, {worst[1][1]}, H={worst[1][2]}, "
               f"{worst[1][3] // 1024}k tokens."])


def report(in_dir, out_dir=None):
    """Markdown tables (the seven rows of issue 18, the whole grid as grpo_lab / min(naive, trl)) and the figure."""
    rows = latest_rows(in_dir)
    out_dir = out_dir or in_dir
    os.makedirs(out_dir, exist_ok=True)
    lines = [f"{rows[0]['gpu']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, trl {rows[0]['trl']}, "
             f"liger {rows[0]['liger']}, {rows[0]['date'][:10]}", ""]
    lines += ["Issue 18's seven rows, ms (loss peak GiB above inputs; grpo_lab: the default memory policy, "
              "grpo_lab+free: without its peak rule, grpo_lab+flat: the policy off):", "",
              "| case | " + " | ".join(REPORT_BACKENDS) + " |", "|---" * (len(REPORT_BACKENDS) + 1) + "|"]

    def cell(key, backend):
        m = [r for r in rows if _key(r) == key and r["backend"] == backend]
        if not m:
            return "—"
        if m[0]["status"] != "ok":
            return m[0]["status"]
        return f"{_num(m[0]['ms']):.1f} ({_num(m[0]['loss_peak_gib']):.2f})"
    for head, dname, hdim, tokens, seq in ISSUE_ROWS:
        key = (head, dname, hdim, tokens, seq)
        case = f"{head}, {dname}, H={hdim}, " + (f"T={seq}, " if seq != T_COMPLETION else "") + f"B={tokens // seq}"
        lines.append(f"| {case} | " + " | ".join(cell(key, b) for b in REPORT_BACKENDS) + " |")
    lines += floor_table(rows)
    lines += bar_table(in_dir)
    lines += ["", "Whole grid: grpo_lab / min(naive, trl) time with the default memory policy (in brackets "
              "grpo_lab+free, the buffer kept wherever the free memory allows, where it was measured and differs).",
              ""]
    keys = sorted({_key(r) for r in rows if r["T"] == str(T_COMPLETION)}, key=lambda k: (k[1], k[0], k[2], k[3]))
    # † marks a cell whose grpo_lab row ran under other kernel knobs than the newest run's (an older kernel)
    newest = max((r for r in rows if r["backend"] == "grpo_lab"), key=lambda r: r["date"])
    latest = newest["date"]
    older = {_key(r) for r in rows if r["backend"] == "grpo_lab"
             and _kernel_knobs(r["setting"]) != _kernel_knobs(newest["setting"])}
    worst, worst_flat = {}, {}
    for dname in dict.fromkeys(k[1] for k in keys):
        for head in ("frozen", "trainable"):
            ks = [k for k in keys if k[0] == head and k[1] == dname]
            if not ks:
                continue
            toks = sorted({k[3] for k in ks})
            lines.append(f"| {dname} {head}: H \\ tokens | " + " | ".join(f"{t // 1024}k" for t in toks) + " |")
            lines.append("|---" * (len(toks) + 1) + "|")
            for hdim in sorted({k[2] for k in ks}):
                cells = []
                for t in toks:
                    key = (head, dname, hdim, t, T_COMPLETION)
                    alt = best_alternative(rows, key)
                    default, flat = backend_ms(rows, key, "grpo_lab"), backend_ms(rows, key, "grpo_lab+free")
                    if math.isnan(alt) or math.isnan(default):
                        cells.append("—")
                        continue
                    worst[(dname, head)] = max(worst.get((dname, head), 0), default / alt)
                    if not math.isnan(flat):
                        worst_flat[(dname, head)] = max(worst_flat.get((dname, head), 0), flat / alt)
                    shown = not math.isnan(flat) and abs(flat - default) > 0.005 * default
                    cells.append(f"{default / alt:.2f}" + (f" ({flat / alt:.2f})" if shown else "")
                                 + ("†" if key in older else ""))
                lines.append(f"| {hdim} | " + " | ".join(cells) + " |")
            lines.append("")
    if older:
        lines.append(f"†: grpo_lab measured with other kernel settings than the newest run's ({latest[:16]}): an "
                     "older kernel; see the CSVs' `date` and `setting` columns.")
    lines.append("Worst grpo_lab (default policy) / min(naive, trl): "
                 + ", ".join(f"{d} {h} {v:.3f}" for (d, h), v in sorted(worst.items())))
    if worst_flat:
        lines.append("Worst grpo_lab+free (no peak rule) / min(naive, trl): "
                     + ", ".join(f"{d} {h} {v:.3f}" for (d, h), v in sorted(worst_flat.items())))
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "loss_grid_tables.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    plot(rows, os.path.join(out_dir, "loss_grid.png"))
    return text


def plot(rows, path):
    """ms vs H (at 32k tokens) and ms vs tokens (at H = 4096), bf16, both head modes, every backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    styles = {"naive": ("s--", "tab:blue"), "trl": ("^-", "tab:orange"), "grpo_lab": ("o-", "tab:green"),
              "grpo_lab+free": ("o:", "tab:red"), "liger": ("x-.", "tab:purple")}
    ok = [r for r in rows if r["status"] == "ok" and r["dtype"] == "bf16" and r["T"] == str(T_COMPLETION)]
    for col, head in enumerate(("frozen", "trainable")):
        for row_i, (axis, fixed, fixed_val) in enumerate((("H", "tokens", 32768), ("tokens", "H", 4096))):
            ax = axes[row_i][col]
            for backend, (style, color) in styles.items():
                pts = sorted((int(r[axis]), _num(r["ms"])) for r in ok
                             if r["head"] == head and r["backend"] == backend and int(r[fixed]) == fixed_val)
                if pts:
                    ax.plot(*zip(*pts), style, color=color, label=backend)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("hidden size H" if axis == "H" else "tokens N")
            ax.set_ylabel("ms, loss fwd+bwd")
            ax.set_title(f"bf16, {head} head, {fixed} = {fixed_val}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    gpus = ", ".join(sorted({r["gpu"] for r in rows}))
    fig.suptitle(f"GRPO loss head on one {gpus}, V = 151,936 (benchmarks/loss_bench.py)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    global V
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/loss_kernel")
    p.add_argument("--hidden", default=None, help=f"H values (grid: {','.join(map(str, GRID_H))}; tune: 1024,4096)")
    p.add_argument("--tokens", default=None,
                   help=f"token counts (grid: {','.join(map(str, GRID_TOKENS))}; tune: 32768)")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help=f"of {','.join(BACKENDS)}")
    p.add_argument("--fp32-full", action="store_true", help="every fp32 grid point (slow: plain SGEMM)")
    p.add_argument("--no-issue-rows", dest="issue_rows", action="store_false")
    p.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    p.add_argument("--accuracy-hidden", default="1024,4096", help="H of the accuracy part")
    p.add_argument("--accuracy-tokens", type=int, default=2048, help="N of the accuracy part")
    p.add_argument("--budget-s", type=float, default=0.3, help="timing budget per point (3-10 reps)")
    p.add_argument("--floor-reps", type=int, default=5, help="timed repeats of each cuBLAS floor GEMM per shape")
    p.add_argument("--repeats", type=int, default=1, help="measure each point this many times, the backends "
                   "interleaved (the `repeat` column): the run-to-run spread of a cell")
    p.add_argument("--max-minutes", type=float, default=60.0, help="stop the grid (cleanly) after this long")
    p.add_argument("--points", default="", help="only these points: head:dtype:H:tokens[:T],... (e.g. a re-run)")
    p.add_argument("--profile", default="", help="torch.profiler kernel table of grpo_lab at these points, first")
    p.add_argument("--tune", action="store_true", help="only the tile sweep of the grpo_lab head (--hidden, "
                   "--tokens, --dtypes and --heads narrow it)")
    p.add_argument("--heads", default="frozen,trainable", help="head modes of the tile sweep")
    p.add_argument("--experiments", default="", help='tile sweep list instead of TUNE_EXPERIMENTS, as JSON or a '
                   'JSON file: {"bf16": [{}, {"p_tma": false}], ...} (tile tuples as lists)')
    p.add_argument("--report", metavar="DIR", help="tables + figure from DIR's loss_grid.csv; no GPU needed")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the harness on the chunked torch path")
    p.add_argument("--vocab", type=int, default=V, help="vocabulary size (smaller only for smoke runs)")
    p.add_argument("--step-batches", default="", help="B for the whole-step memory part, e.g. 8,16,32 ('' skips)")
    args = p.parse_args(argv)
    unknown = [b for b in args.backends.split(",") if b not in BACKENDS]
    if unknown:
        p.error(f"unknown backends {unknown}: choose from {', '.join(BACKENDS)}")
    V = args.vocab
    if args.report:
        report(args.report, args.out if args.out != "results/loss_kernel" else None)
        return 0
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    meta = versions()
    os.makedirs(args.out, exist_ok=True)
    if args.tune:
        text = args.experiments
        if text and os.path.isfile(text):
            with open(text) as f:
                text = f.read()
        experiments = {d: [{k: tuple(v) if isinstance(v, list) else v for k, v in e.items()} for e in exps]
                       for d, exps in json.loads(text).items()} if text else None
        tune(args.out, _ints(args.hidden or "1024,4096"), _ints(args.tokens or "32768"), tuple(args.heads.split(",")),
             tuple(args.dtypes.split(",")), experiments)
        return 0
    if device.type == "cuda":
        from grpo_lab.loss.kernel.tuning import TUNING

        def setting(backend):
            if not backend.startswith("grpo_lab"):
                return ""
            with backend_settings(backend):
                return kernel_setting(TUNING)
    else:
        def setting(backend):
            return "chunked torch path" if backend.startswith("grpo_lab") else ""
    if args.profile:
        profile(parse_points(args.profile), args.out, device)
    if args.accuracy:
        accuracy_rows(args, meta, device, setting)
    rows = run_grid(args, meta, device, setting)
    print(f"\n{len(rows)} grid rows in {os.path.join(args.out, 'loss_grid.csv')}")
    if args.step_batches:
        step_rows(args, meta, device)
    return 0


def step_rows(args, meta, device):
    """Peak memory of a whole GRPO step (forward + backward + AdamW) of a random-init Qwen3-0.6B, 256 prompt + 512
    completion tokens, with each backend as the loss head (bf16; the harness keeps every layer's activations)."""
    from grpo_lab.models import build_model

    config = dapo_config()
    model = build_model("Qwen3-0.6B", torch.bfloat16, device=device)
    model.train()
    rows = []
    for backend in [b for b in args.backends.split(",") if b != "grpo_lab+mem"]:
        for b in map(int, args.step_batches.split(",")):
            fn = make_loss_fn(backend, config)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False)
            gen = torch.Generator(device=device).manual_seed(b)
            ids = torch.randint(0, model.config.vocab_size, (b, 256 + T_COMPLETION), device=device, generator=gen)
            mask = torch.ones(b, T_COMPLETION, device=device, dtype=torch.long)
            adv = torch.randn(b, device=device, generator=gen)

            def step():
                hidden = model.model(input_ids=ids).last_hidden_state[:, 255:-1]
                fn(hidden, model.lm_head.weight, ids[:, 256:], mask, adv).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            _free(device)
            torch.cuda.reset_peak_memory_stats()
            try:
                with backend_settings(backend):
                    step()
                    step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**30
            except torch.OutOfMemoryError:
                peak = float("nan")
            opt.zero_grad(set_to_none=True)
            del opt
            _free(device)
            rows.append({"part": "step", "backend": backend, "dtype": "bf16", "B": b, "prompt_tokens": 256,
                         "completion_tokens": T_COMPLETION, "model": "Qwen3-0.6B (random init)",
                         "step_peak_gib": round(peak, 4), **meta})
            print(f"step bf16 {backend:9s} B={b:3d} peak {peak:.2f} GiB", flush=True)
            write_csv(os.path.join(args.out, "step_bench.csv"), rows)
    return rows


if __name__ == "__main__":
    sys.exit(main())
