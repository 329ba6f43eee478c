"""Measure what the memory planner predicts, with the harness (fresh processes per point), and record both.

    python -m grpo_lab.memory.planner.check --preset cpu_fsdp --out results/memory_planner      # CPU, gloo, W = 1, 2, 4
    python -m grpo_lab.memory.planner.check --preset heldout_h200 --out results/memory_planner  # one H200, ~3 min
    python -m grpo_lab.memory.planner.check --preset nb02_expandable --out results/memory_planner  # one H200, ~7 min

`cpu_fsdp`: FSDP2 + LoRA at world sizes 1, 2, 4 over gloo. `heldout_h200`: settings no constant was fitted to, and
probes 3 % below / above the planner's max batch (the first should fit, the second not) under both allocators.
`nb02_expandable`: notebook 02's fused-head searches re-asked as such pairs under `expandable_segments`. Each row is
the harness's CSV row plus the prediction and its error (docs/memory.md, *Validation*).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from grpo_lab.loss.backends import FUSED_BACKENDS, REFERENCE_BACKENDS

from ...lab.records import run_record
from ..max_batch import _gpu_total_bytes
from ..probe import ProbeError, run_point
from ..results import cli_error, make_row, target_csv, write_csv
from ..spec import EXPANDABLE_SEGMENTS, PointSpec, parse_int_list, parse_str_list
from .predict import GiB, PlannerConfig, max_batch, plan
from .validate import check_row_config

REL_STEP = 0.03  # notebook 02's search resolution: one search step


@dataclass
class CheckPoint:
    spec: PointSpec
    label: str
    expect: str = ""  # "fits" / "oom" for the probes around a predicted max batch
    extra: dict = field(default_factory=dict)  # planner-only settings (e.g. the allocator headroom used)


def planner_config(spec: PointSpec, **overrides) -> PlannerConfig:
    """The planner's view of a harness point."""
    device = "cpu" if spec.device == "cpu" else "cuda"
    return PlannerConfig(model=spec.model, loss_backend=spec.loss_backend, dtype=spec.dtype, batch_size=spec.batch_size,
                         prompt_len=spec.prompt_len, completion_len=spec.completion_len, lora_r=spec.lora_r,
                         world_size=spec.world_size, fsdp=spec.fsdp, device=device,
                         optimizer_state=spec.steps > 1, **overrides)


def cpu_fsdp_points(backends=REFERENCE_BACKENDS, world_sizes=(1, 2, 4)) -> list[CheckPoint]:
    """FSDP2 + LoRA r=8 over gloo at each world size: Qwen3-0.6B, fp32, 2 sequences of 32 + 96 tokens per rank."""
    return [CheckPoint(PointSpec(model="Qwen3-0.6B", loss_backend=b, dtype="fp32", batch_size=2, prompt_len=32,
                                 completion_len=96, lora_r=8, fsdp=True, world_size=w, steps=1, device="cpu"),
                       f"cpu W={w}")
            for b in backends for w in world_sizes]


def heldout_h200_points(budget_gib: float) -> list[CheckPoint]:
    """The held-out H200 configurations (see the module docstring); `budget_gib` is the GPU's memory."""
    base = dict(model="Qwen2.5-Math-1.5B", loss_backend="grpo_lab", dtype="bf16", prompt_len=512, completion_len=1024,
                lora_r=64, fsdp=True, world_size=1, steps=1, device="cuda")
    points = [CheckPoint(PointSpec(batch_size=8, **base), "peak B=8")]
    full_ft = CheckPoint(PointSpec(model="Qwen3-4B", loss_backend="trl", dtype="bf16", batch_size=16, prompt_len=256,
                                   completion_len=512, lora_r=0, steps=2, device="cuda"), "full fine-tuning")
    points += probe_pair(base, budget_gib, expandable=False)
    points.append(full_ft)  # before the expandable-segments pair: the order in which a time limit cuts
    return points + probe_pair(base, budget_gib, expandable=True)


def probe_pair(base: dict, budget_gib: float, expandable: bool) -> list[CheckPoint]:
    """Two probes of the point `base` (PointSpec fields but the batch), 3 % below and 3 % above the planner's max
    batch for that allocator setting: the first should fit, the second not."""
    extra = {"cuda_alloc_conf": EXPANDABLE_SEGMENTS} if expandable else {}
    label = "expandable segments" if expandable else "default allocator"
    pred = max_batch(planner_config(PointSpec(batch_size=8, extra=extra, **base), expandable_segments=expandable),
                     budget_gib).batch
    lo, hi = math.floor(pred * (1 - REL_STEP)), math.ceil(pred * (1 + REL_STEP))
    return [CheckPoint(PointSpec(batch_size=b, extra=extra, **base), f"{label}: 3 % {side} max {pred}",
                       expect, {"predicted_max_batch": pred})
            for b, side, expect in ((lo, "below", "fits"), (hi, "above", "oom"))]


def nb02_expandable_points(budget_gib: float, models=("Qwen3-4B", "Qwen3-8B", "Qwen3-1.7B"),
                           backends=FUSED_BACKENDS) -> list[CheckPoint]:
    """Notebook 02's H200 setting, probed 3 % below / above the planner's max batch with `expandable_segments`
    (the default allocator's fragmentation put 6 of its 12 fused searches more than one step off). Ordered so
    that a time limit cuts the models that already matched under the default allocator (1.7B) last."""
    return [point for model in models for backend in backends
            for point in probe_pair(dict(model=model, loss_backend=backend, dtype="bf16", prompt_len=256,
                                         completion_len=512, lora_r=16, fsdp=True, world_size=1, steps=1,
                                         device="cuda"), budget_gib, expandable=True)]


def run_checks(points: list[CheckPoint], out_csv: Path | None = None, max_seconds: float | None = None,
               on_point=None) -> pd.DataFrame:
    """Measure each point (fresh processes), predict it, and write the CSV after every point."""
    env = run_record(points[0].spec.device if points else "auto")
    rows, t0 = [], time.perf_counter()
    for i, p in enumerate(points):
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            result = {"status": "skipped", "message": f"not run: {max_seconds:.0f}s limit"}
        else:
            try:
                result = run_point(p.spec)
            except ProbeError as e:
                result = {"status": "error", "message": str(e)[-300:]}
        row = make_row("memory_planner", p.spec, result, env)
        predicted = plan(planner_config(p.spec))
        row.update(point=p.label, expect=p.expect, cuda_alloc_conf=p.spec.extra.get("cuda_alloc_conf", ""),
                   predicted_gib=predicted.peak_gib, predicted_phase=predicted.peak_phase, **p.extra)
        if row["status"] == "ok" and row["peak_gib"]:
            row["error_pct"] = 100 * (predicted.peak_gib / row["peak_gib"] - 1)
            if result.get("per_rank"):
                base = result.get("base_bytes") or 0
                row["peak_gib_per_rank"] = " ".join(
                    f"{(r['peak_bytes'] - (base if r.get('memory_kind') == 'cpu_rss' else 0)) / GiB:.3f}"
                    for r in result["per_rank"])
        rows.append(row)
        if out_csv is not None:
            write_csv(pd.DataFrame(rows), out_csv)
        if on_point is not None:
            on_point(row, i, len(points))
    return pd.DataFrame(rows)


def repredict(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a planner.check CSV with the prediction columns recomputed by the current planner (the
    measurements untouched): after a change of the planner, the committed CSVs show what it predicts now."""
    df = df.copy()
    for i, r in df.iterrows():
        p = plan(check_row_config(r))
        df.loc[i, ["predicted_gib", "predicted_phase"]] = [p.peak_gib, p.peak_phase]
        if r["status"] == "ok" and r["peak_gib"]:
            df.loc[i, "error_pct"] = 100 * (p.peak_gib / r["peak_gib"] - 1)
    return df


def _print(row, i, n):
    measured = f"{row['peak_gib']:.3f} GiB" if row.get("peak_gib") else row["status"]
    err = f" error {row['error_pct']:+.1f} %" if row.get("error_pct") is not None else ""
    print(f"[{i + 1}/{n}] {row['model']} {row['backend']} W={row['world_size']} B={row['batch_size']} "
          f"({row['point']}): measured {measured}, predicted {row['predicted_gib']:.3f} GiB{err}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_lab.memory.planner.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["cpu_fsdp", "heldout_h200", "nb02_expandable"])
    ap.add_argument("--out", default="results/memory_planner")
    ap.add_argument("--world-sizes", default="1,2,4", help="cpu_fsdp: comma-separated world sizes")
    ap.add_argument("--backends", default=None,
                    help="comma-separated backends (cpu_fsdp: trl,naive; nb02_expandable: grpo_lab,trl,liger)")
    ap.add_argument("--models", default=None,
                    help="nb02_expandable: comma-separated models (default Qwen3-4B,Qwen3-8B,Qwen3-1.7B)")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="heldout_h200, nb02_expandable: the GPU's memory (default: asked of nvidia-smi)")
    ap.add_argument("--max-minutes", type=float, default=None, help="start no new point after this long")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing CSV")
    ap.add_argument("--repredict", metavar="CSV", help="only recompute the prediction columns of an existing CSV")
    a = ap.parse_args(argv)
    if a.repredict:  # the prediction columns of an existing CSV recomputed in place
        path = Path(a.repredict)
        if not path.is_file():
            return cli_error(f"no CSV {path}")
        write_csv(repredict(pd.read_csv(path)), path)
        print(f"rewrote the predictions in {path}")
        return 0
    if a.preset is None:
        return cli_error("give --preset (cpu_fsdp, heldout_h200 or nb02_expandable) or --repredict CSV")
    try:
        if a.preset == "cpu_fsdp":
            points = cpu_fsdp_points(backends=parse_str_list(a.backends or ",".join(REFERENCE_BACKENDS), "backends"),
                                     world_sizes=parse_int_list(a.world_sizes, "world sizes"))
        else:
            budget = a.budget_gib
            if budget is None:
                total = _gpu_total_bytes()
                if total is None:
                    raise ValueError(f"{a.preset} needs a CUDA GPU (or --budget-gib to only list its points)")
                budget = total / GiB
            if a.preset == "heldout_h200":
                points = heldout_h200_points(budget)
            else:
                picked = {k: parse_str_list(v, k) for k, v in (("models", a.models), ("backends", a.backends)) if v}
                points = nb02_expandable_points(budget, **picked)
        csv = target_csv(a.out, f"planner_{a.preset}", keep=False, overwrite=a.overwrite)
    except ValueError as e:
        return cli_error(e)
    print(f"{len(points)} points → {csv}", flush=True)
    df = run_checks(points, csv, None if a.max_minutes is None else a.max_minutes * 60, _print)
    print(f"wrote {csv}")
    return 1 if (df["status"] == "error").any() else 0


if __name__ == "__main__":
    sys.exit(main())
