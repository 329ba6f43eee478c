"""What notebooks 01 and 02 do, as functions (the notebooks stay thin and the tests can call the same code)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from grpo_lab.lab import environment
from grpo_lab.lab.live_board import ipython_shell
from grpo_lab.loss.backends import BASELINE_BACKEND, REFERENCE_BACKENDS

from .max_batch import PRESETS, build_searches, run_searches
from .planner.validate import markdown_table
from .results import load_reference, ratio_table, rows_to_frame, savings_table
from .sweep import build_specs, run_sweep, save_figures


# the public source of both figures' claims
LIGER_GRPO_POST = 'the Hugging Face blog post "Liger GRPO meets TRL" (huggingface.co/blog/liger-grpo, 2025-05)'


def _mpl():
    import matplotlib

    if environment.matplotlib_backend() is None and ipython_shell() is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------------------------------------
# notebook 01
# ---------------------------------------------------------------------------------------------------------------
def reference_memory_vs_batch() -> pd.DataFrame | None:
    """The committed H200 sweep (results/memory_vs_batch/memory_vs_batch.csv), if it has been committed."""
    return load_reference("memory_vs_batch", "memory_vs_batch.csv")


def run_memory_vs_batch(params: dict, out_dir: str | Path, name: str, board):
    """Run the sweep for `params` (build_specs keywords), updating `board` (a `LiveBoard`) live; save CSV + PNGs.

    Returns (frame, csv_path, [png paths])."""
    plt = _mpl()
    from .plots import plot_memory_vs_batch  # matplotlib: after _mpl() has chosen its backend

    specs = build_specs(**params)
    csv = Path(out_dir) / f"{name}.csv"
    rows: list[dict] = []
    fig = plt.figure(figsize=(11, 4.2))
    board.set_total(len(specs))
    board.status(f"{len(specs)} points, each in a fresh process")

    def on_point(row, i, n):
        rows.append(row)
        peak = (f"{row['peak_gib']:.3f} GiB" if row["status"] == "ok" and row["peak_gib"] is not None
                else row["status"].upper())
        board.step(f"{row['mode']} {row['dtype']} {row['backend']} B={row['batch_size']}: {peak}")
        plot_memory_vs_batch(rows_to_frame(rows), mode=row["mode"], fig=fig)
        board.figure(fig, force=(i + 1 == n))

    df = run_sweep(specs, out_csv=csv, on_point=on_point)
    plt.close(fig)
    pngs = save_figures(df, csv.parent, name)
    board.done(f"{len(df)} points → {csv.name}")
    return df, csv, pngs


def savings_tables(df: pd.DataFrame, mode: str = "step") -> dict[str, pd.DataFrame]:
    d = df[df["mode"] == mode]
    return {ref: savings_table(d, ref) for ref in REFERENCE_BACKENDS}


def closing_note_memory(df: pd.DataFrame | None) -> str:
    """Markdown: the best % saving of each backend vs naive per dtype, next to the "up to 40 %" of the Liger GRPO
    blog post (`LIGER_GRPO_POST`)."""
    if df is None or df.empty:
        return "_No committed H200 results yet: run `python -m grpo_lab.memory.sweep --full` on a GPU._"
    t = savings_table(df[df["mode"] == "step"], BASELINE_BACKEND)
    lines = [f"**{df['gpu_name'].iloc[0]}, {df['model'].iloc[0]}, torch {df['torch'].iloc[0]}, "
             f"trl {df['trl'].iloc[0]} ({df['date'].iloc[0]})** — peak saving vs `naive` on a full GRPO step "
             f"({LIGER_GRPO_POST}: *up to 40 %* lower at large batch):", ""]
    if t.empty:
        return "\n".join(lines + ["_no batch size where naive and a fused backend both ran_"])
    shown = t.dropna(how="all").map(lambda v: v if pd.isna(v) else f"{v:.0f} %")  # all-NaN: naive did not run
    shown = shown.rename(columns=lambda c: c.replace(" vs naive %", "")).reset_index().drop(columns="mode")
    lines.append(markdown_table(shown.rename(columns={"batch_size": "batch"})))
    oom = df[(df["mode"] == "step") & (df["status"] == "oom")]
    for dtype in sorted(set(df["dtype"])):
        first = oom[(oom["backend"] == BASELINE_BACKEND) & (oom["dtype"] == dtype)]["batch_size"]
        if len(first):
            fits = df[(df["mode"] == "step") & (df["dtype"] == dtype) & (df["status"] == "ok") &
                      (df["batch_size"] >= first.min())]
            extra = ", ".join(f"{b} up to B={int(g['batch_size'].max())}" for b, g in fits.groupby("backend"))
            lines.append(f"\n{dtype}: `naive` is out of memory from B={int(first.min())}" +
                         (f"; still running: {extra}." if extra else "."))
    skipped = df[df["status"].isin(["skipped", "error"])]
    if len(skipped):
        lines.append("\nNot measured: " + ", ".join(f"{r['mode']} {r['dtype']} {r['backend']} B={r['batch_size']} "
                                                   f"({r['status']})" for _, r in skipped.iterrows()) + ".")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# notebook 02
# ---------------------------------------------------------------------------------------------------------------
# the committed H200 searches per allocator setting (expandable_segments: True / False)
REFERENCE_MAX_BATCH = {True: "fsdp_max_batch_expandable.csv", False: "fsdp_max_batch.csv"}


def reference_max_batch(expandable_segments: bool = True) -> pd.DataFrame | None:
    """The committed H200 searches made under that allocator setting (None where there are none)."""
    return load_reference("fsdp_max_batch", REFERENCE_MAX_BATCH[bool(expandable_segments)])


def allocator_comparison() -> pd.DataFrame:
    """Max batch per model × backend under the default caching allocator and under expandable_segments (the
    committed H200 searches), with the gain: what the allocator setting alone is worth."""
    frames = {k: reference_max_batch(k) for k in (False, True)}
    if any(f is None or f.empty for f in frames.values()):
        return pd.DataFrame()
    key = ["model", "backend"]
    both = frames[False].merge(frames[True], on=key, suffixes=("_default", "_expandable"))
    both = both[(both["status_default"] == "ok") & (both["status_expandable"] == "ok")]
    out = both[key].copy()
    for k in ("default", "expandable"):
        capped = both[f"capped_{k}"].astype(bool)
        out[k] = [f"≥{b}" if c else str(b) for b, c in zip(both[f"max_batch_{k}"], capped)]
    bounded = both["capped_default"].astype(bool) | both["capped_expandable"].astype(bool)
    gain = 100 * (both["max_batch_expandable"] / both["max_batch_default"] - 1)
    out["gain"] = ["" if b else f"{g:+.0f} %" for g, b in zip(gain, bounded)]
    # the full preset's order (models by size, then naive, trl, grpo_lab, liger); others after them
    rank = {v: i for i, v in enumerate([*PRESETS["full"]["models"], *PRESETS["full"]["backends"]])}
    return out.sort_values(key, key=lambda c: c.map(lambda v: rank.get(v, len(rank)))).set_index(key)


def run_max_batch(params: dict, out_dir: str | Path, name: str, board):
    """Max-batch search for every model × backend in `params`, live on `board`; saves CSV + PNG. Returns (frame,
    csv, png)."""
    plt = _mpl()
    from .plots import plot_max_batch, save_png  # matplotlib: after _mpl() has chosen its backend

    searches = build_searches(**params)
    csv = Path(out_dir) / f"{name}.csv"
    fig = plt.figure(figsize=(11, 4.5))
    board.set_total(len(searches))
    board.status(f"{len(searches)} searches (model × backend)")

    def on_probe(spec, outcome):
        board.status(f"{spec.model} {spec.loss_backend}: B={spec.batch_size} → {outcome}")

    def on_search(frame, i, n):
        r = frame.iloc[-1]
        board.step(f"{r['model']} {r['backend']}: max batch {r['max_batch']}")
        plot_max_batch(frame, fig=fig)
        board.figure(fig, force=(i + 1 == n))

    df = run_searches(searches, out_csv=csv, on_probe=on_probe, on_search=on_search)
    png = save_png(plot_max_batch(df, fig=fig), csv.with_suffix(".png"))
    board.done(f"{len(df)} searches → {csv.name}")
    return df, csv, png


def closing_note_max_batch(df: pd.DataFrame | None) -> str:
    if df is None or df.empty:
        return "_No committed H200 results yet: run `python -m grpo_lab.memory.max_batch --full` on a GPU._"
    t = ratio_table(df)
    r = df.iloc[0]
    alloc = r.get("cuda_alloc_conf")
    alloc = f"PYTORCH_CUDA_ALLOC_CONF={alloc}" if isinstance(alloc, str) and alloc else "default caching allocator"
    lines = [f"**{r['gpu_name']}, FSDP2 + LoRA r={r['lora_r']}, {r['dtype']}, {r['prompt_len']}+{r['completion_len']} "
             f"tokens, world size {r['world_size']}, budget {r['budget_gib']:.1f} GiB, {alloc} ({r['date']})** — "
             f"max per-device batch ({LIGER_GRPO_POST}: *1.5–1.8×* larger with the chunked loss):", "",
             markdown_table(t, index=True)]
    missing = df[~df["status"].isin(["ok", "incomplete"])] if "status" in df else df.iloc[0:0]
    if len(missing):
        lines += ["", "Not run: " + ", ".join(f"{r['model']} {r['backend']} ({r['status']})"
                                              for _, r in missing.iterrows()) + "."]
    return "\n".join(lines)

