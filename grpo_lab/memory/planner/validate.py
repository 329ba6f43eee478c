"""The planner's predictions against every committed measurement: one row per point, the error in %, and the
max-batch searches against the planner's max batch.

    python -m grpo_lab.memory.planner.validate --out results/memory_planner   # validation{,_max_batch}.csv + .md

Sources: every committed measurement under `results/` (notebooks 01 and 02, the loss-kernel grid, `planner.check`'s
CPU and H200 runs). `calibration` names the constant a source was used to fit (empty: a pure prediction); rows
measured with a kernel that has changed since are kept, marked, and left out of the summary.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from grpo_lab.loss.backends import BASELINE_BACKEND, LOSS_BACKENDS

from .predict import GiB, PlannerConfig, max_batch, max_batch_band, plan, plan_loss_only
from ..results import cli_error, load_reference, text_column
from ..spec import EXPANDABLE_SEGMENTS

TARGET_PCT = 10.0  # the target: within 10 % of the measured peak
# where and with what each point was measured, copied from its source row (the loss grid names the GPU `gpu`)
PROVENANCE = ["machine", "torch", "trl", "transformers", "measured_on"]
COLUMNS = ["source", "model", "backend", "dtype", "mode", "batch_size", "prompt_len", "completion_len", "lora_r",
           "world_size", "fsdp", "device", "measured_gib", "predicted_gib", "error_pct", "phase", "calibration",
           "note", *PROVENANCE]
# grpo_lab kernel changes after a measurement (grpo_lab/loss/kernel/ history, docs/kernel.md)
OLD_KERNEL_NB01 = "grpo_lab kernel of 2026-12-02 (before the run-4 tiles); the planner models today's"
OLD_KERNEL_FROZEN = "frozen head measured before its backward temporaries were bounded (5700679)"
OLD_KERNEL_FROZEN_TILE = "frozen 16-bit head measured on 128 x 128 tiles (before issue 45): twice today's partial sums"
OLD_KERNEL_FP32_MM = ("fp32 trainable head measured with cuBLAS dX / dW on 8192-token dZ tiles (before issue 45's "
                      "split-TF32 default): no K-major copies, a dZ tile twice as tall")
OLD_KERNEL_NOTES = (OLD_KERNEL_NB01, OLD_KERNEL_FROZEN, OLD_KERNEL_FROZEN_TILE,
                    OLD_KERNEL_FP32_MM)  # rows the summary leaves out
# benchmarks/loss_bench.py's grid runs, oldest first; where several measured a point, the latest (by date) counts
LOSS_GRID_RUNS = ("loss_grid.csv", "loss_grid_run6.csv", "loss_grid_run7.csv")
# later loss-head runs on another card, each its own source: (file under results/loss_kernel, source label)
LOSS_HEAD_RUNS = (("h100_issue45_split/loss_grid_split.csv", "H100 loss kernel, split-TF32 fp32 (head alone)"),)


def _config(row, **kw) -> PlannerConfig:
    return PlannerConfig(model=row["model"], loss_backend=row["backend"], dtype=row["dtype"],
                         batch_size=int(row.get("batch_size", 1)), prompt_len=max(1, int(row.get("prompt_len") or 1)),
                         completion_len=int(row["completion_len"]), **kw)


def _multi_step(row) -> bool:
    """Whether the measured run took more than one step (so AdamW's state existed); no `steps` column: one."""
    return int(row.get("steps") if pd.notna(row.get("steps")) else 1) > 1


def provenance(row) -> dict:
    """The machine, versions and date a source row records (blank where it records none)."""
    def get(*names):
        return next((str(row.get(name)) for name in names if pd.notna(row.get(name))), "")

    return {"machine": get("gpu_name", "gpu"), "torch": get("torch"), "trl": get("trl"),
            "transformers": get("transformers"), "measured_on": get("date")[:10]}


def _row(source, p, mode, measured, src, calibration="", note="") -> dict:
    """A point of source row `src`: its measured peak (GiB) against the plan `p` of its setting."""
    cfg = p.config
    return {**provenance(src), "source": source, "model": cfg.model, "backend": cfg.loss_backend,
            "dtype": cfg.dtype, "mode": mode, "batch_size": cfg.batch_size, "prompt_len": cfg.prompt_len,
            "completion_len": cfg.completion_len, "lora_r": cfg.lora_r, "world_size": cfg.world_size,
            "fsdp": cfg.fsdp, "device": cfg.device, "measured_gib": measured, "predicted_gib": p.peak_gib,
            "error_pct": 100 * (p.peak_gib / measured - 1), "phase": p.peak_phase, "calibration": calibration,
            "note": note}


def notebook01_rows(df: pd.DataFrame) -> list[dict]:
    """Notebook 01 (Qwen3-0.6B, full fine-tuning, 2 steps, no FSDP): training steps and the loss alone."""
    out = []
    for _, r in df[df["status"] == "ok"].iterrows():
        step = r["mode"] == "step"
        cfg = _config(r, lora_r=0, fsdp=False)
        p = plan(cfg) if step else plan_loss_only(cfg)
        note = OLD_KERNEL_NB01 if not step and r["backend"] == "grpo_lab" else ""
        out.append(_row(f"H200 notebook 01 ({'step' if step else 'loss alone'})", p, r["mode"], r["peak_gib"],
                        r, note=note))
    return out


def loss_kernel_rows(df: pd.DataFrame, source: str = "H200 loss kernel (head alone)") -> list[dict]:
    """`benchmarks/loss_bench.py`'s grid (the LM head alone, peak above the inputs, entropy detached); the latest
    run per point. The materialised head (`grpo_lab+mem`, opt-in) is not planned."""
    from transformers import AutoConfig

    df = df[(df["status"] == "ok") & (df["part"] == "loss") & df["backend"].isin(LOSS_BACKENDS)]
    df = df.drop_duplicates(subset=["backend", "head", "dtype", "H", "tokens", "T"], keep="last")
    out = []
    for _, r in df.iterrows():
        head = AutoConfig.for_model("qwen3", hidden_size=int(r["H"]), intermediate_size=3 * int(r["H"]),
                                    num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                                    vocab_size=int(r["V"]), tie_word_embeddings=False)
        cfg = PlannerConfig(model=f"head H={int(r['H'])}", model_config=head, loss_backend=r["backend"], dtype=r["dtype"],
                            batch_size=int(r["B"]), prompt_len=1, completion_len=int(r["T"]))
        p = plan_loss_only(cfg, trainable=r["head"] == "trainable", entropy_grad=False, with_inputs=False)
        setting = str(r.get("setting", ""))
        old = "P~ descriptor store" not in setting  # the setting column names it since run 7
        note = ""
        if r["backend"] == "grpo_lab" and r["head"] == "frozen":
            if old:
                note = OLD_KERNEL_FROZEN
            elif r["dtype"] != "fp32" and "frozen_16:128x128x" in setting:
                note = OLD_KERNEL_FROZEN_TILE
        elif r["backend"] == "grpo_lab" and r["dtype"] == "fp32" and "fp32 dX/dW triton" not in setting:
            note = OLD_KERNEL_FP32_MM
        row = _row(source, p, f"loss, {r['head']} head", r["loss_peak_gib"], r, note=note)
        row["lora_r"] = 0 if r["head"] == "trainable" else None
        out.append(row)
    return out


def check_row_config(r) -> PlannerConfig:
    """The planner's view of a row written by `planner.check` (or by the harness)."""
    return _config(r, lora_r=int(r["lora_r"]), fsdp=bool(r["fsdp"]), world_size=int(r["world_size"]),
                   device="cpu" if r["memory_kind"] == "cpu_rss" else "cuda", optimizer_state=_multi_step(r))


def planner_check_rows(df: pd.DataFrame, source: str, calibration: str = "") -> list[dict]:
    """Rows written by `planner.check` (the CPU gloo runs, the held-out H200 check)."""
    return [_row(source, plan(check_row_config(r)), "step", r["peak_gib"], r, calibration,
                 str(r.get("point", ""))) for _, r in df[df["status"] == "ok"].iterrows()]


def max_batch_rows(searches: pd.DataFrame) -> list[dict]:
    """Max-batch searches (notebook 02's CSV: any device or world size) against the planner's max batch for the
    same budget. The search brackets the limit in [max_batch, first_oom); the prediction is within one search step
    when it lies in that bracket widened by one step on each side (a capped search: when it does not fall more
    than a step below the cap)."""
    out = []
    for _, r in searches[searches["status"] == "ok"].iterrows():
        device = "cpu" if str(r.get("device", "cuda")) == "cpu" else "cuda"
        alloc = r.get("cuda_alloc_conf")
        cfg = _config(r, lora_r=int(r["lora_r"]), fsdp=True, world_size=int(r["world_size"]), device=device,
                      optimizer_state=_multi_step(r),
                      expandable_segments=isinstance(alloc, str) and EXPANDABLE_SEGMENTS in alloc)
        upper = int(r["max_batch"]) if bool(r["capped"]) else 1 << 14
        pred = max_batch(cfg.replace(batch_size=1), float(r["budget_gib"]), upper=upper)
        measured, first_oom = int(r["max_batch"]), (None if pd.isna(r["first_oom"]) else int(r["first_oom"]))
        step = max(1, math.floor(float(r["rel_tol"]) * measured))  # its resolution, as search_max_batch's gap
        hi = measured if first_oom is None else first_oom - 1
        within = measured - step <= pred.batch <= hi + step
        band = max_batch_band(cfg, float(r["budget_gib"]), upper=upper) if not bool(r["capped"]) else None
        # the limit lies in [measured, hi]; the band holds it when the two ranges overlap
        in_band = None if band is None else bool(band[0] <= hi and measured <= band[1])
        source = f"{'CPU' if device == 'cpu' else 'H200'} notebook 02 (searches" + (
            ", expandable segments)" if cfg.expandable_segments else ")")
        out.append({"source": source, "model": cfg.model, "backend": cfg.loss_backend, "device": device,
                    "allocator": "expandable segments" if cfg.expandable_segments else "default",
                    "lora_r": cfg.lora_r, "world_size": cfg.world_size,
                    "budget_gib": float(r["budget_gib"]), "measured_max_batch": measured, "first_oom": first_oom,
                    "capped": bool(r["capped"]), "predicted_max_batch": pred.batch,
                    "error_pct": 100 * (pred.batch / measured - 1), "search_step": step,
                    "within_one_step": within,
                    "default_allocator_band": "" if band is None else f"{band[0]}-{band[1]}", "within_band": in_band,
                    "predicted_peak_gib": pred.peak_bytes / GiB,
                    "usable_gib": pred.usable_bytes / GiB, "calibration": "ALLOCATOR_HEADROOM", **provenance(r)})
    return out


# notebook 02's committed searches: the H200 under each allocator setting, the CPU quick preset
NOTEBOOK02_SEARCHES = ("fsdp_max_batch.csv", "fsdp_max_batch_expandable.csv", "fsdp_max_batch_quick.csv")


def max_batch_table() -> pd.DataFrame:
    """Every committed max-batch search of notebook 02 (the H200 runs and the CPU quick preset) against the
    planner."""
    found = [df for name in NOTEBOOK02_SEARCHES if (df := load_reference("fsdp_max_batch", name)) is not None]
    return pd.DataFrame(max_batch_rows(pd.concat(found, ignore_index=True))) if found else pd.DataFrame()


def probe_pair_rows(df: pd.DataFrame) -> list[dict]:
    """A planner.check CSV's probe pairs 3 % below / above the predicted max batch, one row per model, backend,
    LoRA rank and allocator setting."""
    out = []
    pairs = df[df["expect"].isin(["fits", "oom"])] if "expect" in df else df.iloc[0:0]
    keys = [pairs["model"], pairs["backend"], pairs["lora_r"], text_column(pairs, "cuda_alloc_conf")]
    for (*_, alloc), g in pairs.groupby(keys, sort=False):
        lo, hi = g[g["expect"] == "fits"], g[g["expect"] == "oom"]
        if lo.empty or hi.empty:
            continue
        lo, hi = lo.iloc[0], hi.iloc[0]
        ran = lo["status"] in ("ok", "oom") and hi["status"] in ("ok", "oom")
        out.append({"model": lo["model"], "backend": lo["backend"], "lora_r": int(lo["lora_r"]),
                    "allocator": alloc or "default", "predicted_max_batch": int(lo["predicted_max_batch"]),
                    "below": int(lo["batch_size"]), "below_status": lo["status"],
                    "above": int(hi["batch_size"]), "above_status": hi["status"],
                    "within_one_step": (lo["status"] == "ok" and hi["status"] == "oom") if ran else None})
    return out


def validation_table(extra_csvs: dict[str, Path] | None = None) -> pd.DataFrame:
    """Every committed measurement with its prediction (see the module docstring)."""
    rows: list[dict] = []
    nb01 = load_reference("memory_vs_batch", "memory_vs_batch.csv")
    if nb01 is not None:
        rows += notebook01_rows(nb01)
    # notebook 02's probes (FSDP2 + LoRA, world size 1, one step): harness rows, as planner.check writes; less
    # those seeded from planner.check's CSV (they are its rows below)
    for name, source in (("fsdp_max_batch_probes.csv", "H200 notebook 02 (probes)"),
                         ("fsdp_max_batch_expandable_probes.csv",
                          "H200 notebook 02 (probes, expandable segments)")):
        nb02 = load_reference("fsdp_max_batch", name)
        if nb02 is not None:
            own = text_column(nb02, "seeded_from") == ""
            rows += planner_check_rows(nb02[own], source, calibration="CUDA_WORKSPACE_BYTES")
    grid = [g for name in LOSS_GRID_RUNS if (g := load_reference("loss_kernel", name)) is not None]
    if grid:
        rows += loss_kernel_rows(pd.concat(grid, ignore_index=True).sort_values("date", kind="stable"))
    for name, source in LOSS_HEAD_RUNS:
        if (run := load_reference("loss_kernel", name)) is not None:
            rows += loss_kernel_rows(run, source)
    for name, source, calibration in (("planner_cpu_fsdp.csv", "CPU gloo FSDP2 (RSS)", "CPU_RSS_OVERHEAD_BYTES"),
                                      *((name, source, "") for name, source in PROBE_CSVS)):
        df = _planner_csv(name, extra_csvs)
        if df is not None:
            rows += planner_check_rows(df, source, calibration)
    return pd.DataFrame(rows, columns=COLUMNS)


# planner.check CSVs with probe pairs around a predicted max batch, and their source label
PROBE_CSVS = (("planner_heldout_h200.csv", "H200 held-out"),
              ("planner_nb02_expandable.csv", "H200 notebook 02 setting, expandable segments"))


def probe_pairs(extra_csvs: dict[str, Path] | None = None) -> pd.DataFrame:
    """Every committed probe pair (3 % below / above a predicted max batch), with its source."""
    rows = []
    for name, source in PROBE_CSVS:
        df = _planner_csv(name, extra_csvs)
        if df is not None:
            rows += [{"source": source, **r} for r in probe_pair_rows(df)]
    return pd.DataFrame(rows)


def probe_pair_summary(pairs: pd.DataFrame) -> pd.DataFrame:
    """Per source and allocator: pairs run, and how many put the true limit within one step of the prediction."""
    if pairs.empty:
        return pd.DataFrame()
    ran = pairs[pairs["within_one_step"].notna()]
    g = ran.groupby(["source", "allocator"], sort=False)
    return pd.DataFrame({"pairs": g.size(),
                         "within_one_step": g["within_one_step"].apply(_tally)})


def _tally(flags: pd.Series) -> str:
    """"k/n": how many of the known flags hold (missing ones, a check that does not apply, are not counted)."""
    known = flags.dropna()
    return f"{int(known.sum())}/{len(known)}"


def _planner_csv(name: str, extra_csvs: dict[str, Path] | None) -> pd.DataFrame | None:
    if extra_csvs and name in extra_csvs:
        return pd.read_csv(extra_csvs[name])
    return load_reference("memory_planner", name)


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per source: points, max, median and mean |error|, share within the 10 % target (rows with a note excluded)."""
    kept = table[~table["note"].isin(OLD_KERNEL_NOTES)]
    g = kept.assign(abs_err=kept["error_pct"].abs()).groupby("source", sort=False)
    return pd.DataFrame({"points": g.size(), "max_abs_error_pct": g["abs_err"].max(),
                         "median_abs_error_pct": g["abs_err"].median(), "mean_abs_error_pct": g["abs_err"].mean(),
                         "within_10pct": g["abs_err"].apply(lambda e: f"{(e <= TARGET_PCT).sum()}/{len(e)}")})


def max_batch_summary(searches: pd.DataFrame) -> pd.DataFrame:
    """Per source and head kind (naive / fused): searches, max and median |error| of the max batch, how many
    predictions lie within one search step of the measured limit."""
    if searches.empty:
        return pd.DataFrame()
    kind = searches["backend"].where(searches["backend"] == BASELINE_BACKEND, "fused")
    g = searches.assign(head=kind, abs_err=searches["error_pct"].abs()).groupby(["source", "head"], sort=False)
    return pd.DataFrame({"searches": g.size(), "max_abs_error_pct": g["abs_err"].max(),
                         "median_abs_error_pct": g["abs_err"].median(),
                         "within_one_step": g["within_one_step"].apply(_tally),
                         "within_default_allocator_band": g["within_band"].apply(
                             lambda w: _tally(w) if w.notna().any() else "")})


def markdown_table(df: pd.DataFrame, index: bool = False, floatfmt: str = "{:.2f}") -> str:
    """A pipe table of `df` (floats formatted with `floatfmt`, missing values blank)."""
    df = df.reset_index() if index else df

    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        return floatfmt.format(v) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def to_markdown(table: pd.DataFrame, searches: pd.DataFrame, heldout: pd.DataFrame | None = None) -> str:
    """The validation as markdown: the summary, the max-batch table, then every point."""
    fmt = {"measured_gib": "{:.3f}", "predicted_gib": "{:.3f}", "error_pct": "{:+.1f}"}
    lines = ["# Memory planner: predicted vs measured", "",
             "Generated by `python -m grpo_lab.memory.planner.validate` from the committed CSVs "
             "(docs/memory.md, section *Memory planner*). Error = predicted / measured − 1. Rows with a note were "
             "measured with a kernel that has changed since; they are listed, not summarised.", "",
             "## Summary (peak memory)", "", markdown_table(summary(table), index=True), "",
             "## Summary (max batch)", "", markdown_table(max_batch_summary(searches), index=True), "",
             "## Max batch: notebook 02's searches (H200: FSDP2 + LoRA r=16, world size 1, whole GPU, under the "
             "default caching allocator and under `expandable_segments`; CPU: the quick preset, a cap on peak RSS)",
             "", "Under the default allocator a fused head's limit moves with fragmentation the planner does not "
             "model (7-17 % of the GPU): there the prediction is a point inside a band (`default_allocator_band`). "
             "Under `expandable_segments`, notebook 02's default since 2026-12-03, it is the limit itself.", "",
             markdown_table(searches.drop(columns=["calibration", "torch", "trl", "transformers"],
                                          errors="ignore"), floatfmt="{:.1f}"), ""]
    if heldout is not None and not heldout.empty:
        lines += ["## Max batch, probed: 3 % below / above the predicted max batch", "",
                  "The first should fit and the second not: then the true limit is within one search step of the "
                  "prediction. The `expandable_segments` searches above started from the second source's pairs "
                  "(`--seed-probes`), which are counted here and not again among the searches' probes.", "",
                  markdown_table(probe_pair_summary(heldout), index=True), "", markdown_table(heldout), ""]
    lines += ["## Every point", ""]
    shown = table.copy()
    for col, f in fmt.items():
        shown[col] = shown[col].map(f.format)
    lines.append(markdown_table(shown.drop(columns=["fsdp", "torch", "trl", "transformers"])))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_lab.memory.planner.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/memory_planner")
    ap.add_argument("--heldout-csv", help="a planner_heldout_h200.csv not committed yet (e.g. just fetched)")
    a = ap.parse_args(argv)
    extra = {"planner_heldout_h200.csv": Path(a.heldout_csv)} if a.heldout_csv else None
    if extra and not extra["planner_heldout_h200.csv"].is_file():
        return cli_error(f"no CSV {a.heldout_csv}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = validation_table(extra)
    searches = max_batch_table()
    heldout = probe_pairs(extra)
    table.to_csv(out / "validation.csv", index=False)
    searches.to_csv(out / "validation_max_batch.csv", index=False)
    (out / "validation.md").write_text(to_markdown(table, searches, heldout))
    with pd.option_context("display.width", 160):
        print(summary(table).to_string())
        if not searches.empty:
            print(max_batch_summary(searches).to_string())
            print(searches[["source", "model", "backend", "measured_max_batch", "first_oom", "predicted_max_batch",
                            "error_pct", "within_one_step"]].to_string(index=False))
        if not heldout.empty:
            print(probe_pair_summary(heldout).to_string())
    print(f"wrote {out / 'validation.csv'}, {out / 'validation_max_batch.csv'} and {out / 'validation.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
