"""Figures for notebooks 01 and 02 (matplotlib, Agg-safe): peak memory vs batch size, max batch per model size."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.ticker import NullFormatter

from grpo_lab.loss.backends import BACKEND_COLORS, BACKEND_MARKERS, REFERENCE_BACKENDS, in_display_order

from .results import bound_kind, max_batch_label, max_batch_ratio


def save_png(fig, path) -> Path:
    """`fig` written at the committed figures' resolution, then closed."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_memory_vs_batch(df: pd.DataFrame, mode: str = "step", fig=None, dtypes=("fp32", "bf16")):
    """FP32 and BF16 panels side by side: peak GiB vs batch size per backend; out-of-memory points as ×."""
    import matplotlib.pyplot as plt

    d = df[df["mode"] == mode] if "mode" in df else df
    if fig is None:
        fig = plt.figure(figsize=(11, 4.2))
    fig.clear()
    axes = fig.subplots(1, len(dtypes), sharey=False, squeeze=False)[0]
    for ax, dtype in zip(axes, dtypes):
        part = d[d["dtype"] == dtype]
        ymax = part["peak_gib"].max() if part["peak_gib"].notna().any() else 1.0
        for backend in in_display_order(part["backend"]):
            b = part[part["backend"] == backend].sort_values("batch_size")
            style = {k: v for k, v in (("color", BACKEND_COLORS.get(backend)),  # none for a name not a backend
                                       ("marker", BACKEND_MARKERS.get(backend))) if v}
            ok = b[b["status"] == "ok"]
            ax.plot(ok["batch_size"], ok["peak_gib"], label=backend, lw=2, ms=5, **style)
            oom = b[b["status"] == "oom"]
            if len(oom):
                ax.scatter(oom["batch_size"], [ymax * 1.06] * len(oom), marker="x", s=60,
                           color=style.get("color", "k"), zorder=5)
        sizes = sorted(int(b) for b in part["batch_size"].unique())
        if sizes:  # log2 axis labelled with the measured batch sizes as plain numbers (48, 96: not powers of 2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.xaxis.set_minor_formatter(NullFormatter())
        else:
            ax.text(0.5, 0.5, f"no {dtype} points", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("batch size (sequences per step)")
        kind = part["memory_kind"].iloc[0] if len(part) else ""
        ax.set_ylabel("peak memory (GiB)" + (" — RSS above baseline" if kind == "cpu_rss" else ""))
        ax.set_title(f"{dtype.upper()}")
        ax.grid(alpha=0.3)
        if len(part):
            ax.set_ylim(0, ymax * 1.12)
            ax.legend(title="loss backend (× = OOM)", fontsize=8)
    what = "GRPO training step (fwd+bwd+AdamW)" if mode == "step" else "loss stage alone (fwd+bwd)"
    r = d.iloc[0] if len(d) else None
    where = "" if r is None else f"{r['model']} · {r.get('gpu_name', '')} · {r.get('date', '')}"
    fig.suptitle(f"Peak memory vs batch size — {what}\n{where}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_max_batch(df: pd.DataFrame, fig=None):
    """Bars: max per-device batch per model size and backend, labelled with the ratio to naive and to trl."""
    import matplotlib.pyplot as plt
    import numpy as np

    if fig is None:
        fig = plt.figure(figsize=(11, 4.5))
    fig.clear()
    ax = fig.subplots()
    if df.empty:
        return fig
    models = list(dict.fromkeys(df["model"]))
    backends = in_display_order(df["backend"])
    title_row = df.iloc[0]
    if "status" in df:  # "incomplete": a search cut short with a bracket; drawn as its lower bound, hatched
        drawn = df["status"].isin(["ok", "incomplete"])
        failed, df = df[~drawn], df[drawn]
    else:
        failed = df.iloc[0:0]
    width = 0.8 / max(1, len(backends))
    crowded = len(backends) > 3
    x = np.arange(len(models))
    top = max(1, df["max_batch"].max()) if len(df) else 1
    for i, backend in enumerate(backends):
        sels = [df[(df["model"] == m) & (df["backend"] == backend)] for m in models]
        vals = [int(s["max_batch"].iloc[0]) if len(s) and pd.notna(s["max_batch"].iloc[0]) else 0 for s in sels]
        bounds = [bound_kind(s.iloc[0]) if len(s) else "" for s in sels]
        pos = x + (i - (len(backends) - 1) / 2) * width
        color = BACKEND_COLORS.get(backend)
        bars = ax.bar(pos, vals, width, label=backend, color=color)
        for bar, kind in zip(bars, bounds):
            if kind == "incomplete":
                bar.set_hatch("//")
                bar.set_facecolor("none")
                bar.set_edgecolor(color)
        for m, sel, p, v in zip(models, sels, pos, vals):
            f = failed[(failed["model"] == m) & (failed["backend"] == backend)]
            if len(f):
                ax.text(p, top * 0.01, str(f["status"].iloc[0]), ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            if sel.empty:  # this backend was not searched for this model
                continue
            labels = [max_batch_label(sel.iloc[0])]
            for ref in REFERENCE_BACKENDS:
                rr = df[(df["model"] == m) & (df["backend"] == ref)]
                if backend != ref and len(rr) and (ratio := max_batch_ratio(sel.iloc[0], rr.iloc[0])):
                    labels.append(ratio + ref[0])
            # crowded: one rotated line per bar, so neighbouring labels do not run into each other
            ax.text(p, v + top * 0.01, (" " if crowded else "\n").join(labels), ha="center", va="bottom",
                    fontsize=7, rotation=90 if crowded else 0)
    ax.set_xticks(x, models)
    ax.set_ylabel("max per-device batch that fits")
    ax.set_ylim(0, top * (1.45 if crowded else 1.3))
    ax.legend(title="loss backend (×n = vs naive, ×t = vs trl)", fontsize=8, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    r = title_row
    alloc = r.get("cuda_alloc_conf")
    alloc = f" · {alloc}" if isinstance(alloc, str) and alloc else ""
    ax.set_title(f"FSDP2 + LoRA r={r.get('lora_r', '')}: max batch, {r.get('dtype', '')}, "
                 f"{r.get('prompt_len', '')}+{r.get('completion_len', '')} tokens, world size {r.get('world_size', '')}"
                 f", budget {r.get('budget_gib', 0):.3g} GiB\n{r.get('gpu_name', '')} · {r.get('date', '')}{alloc}",
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
