"""Notebook 02's memory planner panel, from core ipywidgets only (Colab's 7.7 and 8.x): a setting → the predicted
peak and max batch, and the max batch over 1–8 GPUs with measured searches overlaid as circles. Without ipywidgets
or a kernel, `show()` displays the same summary and figure once.
"""

from __future__ import annotations

import html

import pandas as pd

from grpo_lab.lab.live_board import fig_to_png
from grpo_lab.lab.widgets import label_width_px, widget_module
from grpo_lab.loss.backends import BASELINE_BACKEND, DEFAULT_LOSS_BACKEND, DISPLAY_ORDER
from grpo_lab.models import known_model_names

from .predict import GiB, PlannerConfig, max_batch, plan
from .report import H200_GIB, measured_points, plot_world_sizes, world_size_table
from .validate import max_batch_rows
from ..notebook import reference_max_batch
from ..results import text_column

LABELS = {"model": "model", "gpus": "GPUs", "gib": "GiB per GPU", "dtype": "dtype", "lora_r": "LoRA r",
          "loss_backend": "backend", "prompt_len": "prompt len", "completion_len": "completion len",
          "checkpointing": "checkpointing", "expandable_segments": "expandable segments"}


def summary_html(config: PlannerConfig, budget_gib: float) -> str:
    """One paragraph: the max batch per GPU and the peak there (both predicted), and which phase sets it."""
    best = max_batch(config, budget_gib)
    usable = best.usable_bytes / GiB
    gpus = f"{config.world_size} GPU{'s' if config.world_size > 1 else ''} × {budget_gib:g} GiB"
    label = "predicted" if config.world_size == 1 else "predicted: multi-GPU, not measured here"
    if best.batch == 0:
        return (f"<b>max batch per GPU: 0</b> ({label}) — on {gpus} even one sequence needs "
                f"<b>{best.peak_bytes / GiB:.1f} GiB</b> of {usable:.1f} GiB usable")
    at = plan(config.replace(batch_size=best.batch))
    terms = ", ".join(f"{k} {v:.1f}" for k, v in list(at.breakdown().items())[:4])
    return (f"<b>max batch per GPU: {best.batch}{' or more' if best.capped else ''}</b> ({label}; "
            f"{best.batch * config.world_size} sequences per step on {gpus}); peak there "
            f"<b>{at.peak_gib:.1f} GiB</b> of {usable:.1f} GiB usable (the budget less the allocator's headroom), "
            f"in <code>{html.escape(at.peak_phase)}</code> (GiB: {html.escape(terms)} …)")


def world_size_figure(config: PlannerConfig, budget_gib: float, searches: pd.DataFrame | None = None):
    """Predicted max batch over world size for the baseline (naive) and the chosen backend, measured searches
    overlaid."""
    backends = tuple(dict.fromkeys((BASELINE_BACKEND, config.loss_backend)))
    table = world_size_table(config, budget_gib, backends=backends)
    measured = measured_points(searches, config, budget_gib)
    ckpt = "" if config.gradient_checkpointing else ", no checkpointing"
    title = (f"{config.model} {config.dtype}, FSDP2 + LoRA r={config.lora_r}, {config.prompt_len}+"
             f"{config.completion_len} tokens, {budget_gib:g} GiB per GPU{ckpt}")
    return plot_world_sizes(table, measured[measured["backend"].isin(backends)], title)


def with_committed_searches(searches: pd.DataFrame | None) -> pd.DataFrame | None:
    """`searches` (just measured in the notebook) together with the committed H200 searches of both allocator
    settings, so the plot overlays every measurement of a setting; a search repeated is kept once (the newer, from
    `searches`)."""
    frames = [df for df in (reference_max_batch(False), reference_max_batch(True), searches)
              if df is not None and not df.empty]
    if not frames:
        return None
    both = pd.concat(frames, ignore_index=True)
    both["cuda_alloc_conf"] = text_column(both, "cuda_alloc_conf")
    keys = ["model", "backend", "dtype", "lora_r", "world_size", "prompt_len", "completion_len", "budget_gib", "device",
            "cuda_alloc_conf"]
    return both.drop_duplicates(subset=keys, keep="last")


class PlannerPanel:
    """The interactive planner (see the module docstring). `searches`: notebook 02's searches to overlay."""

    def __init__(self, model="Qwen3-8B", gpus=1, gib=H200_GIB, dtype="bf16", lora_r=16,
                 loss_backend=DEFAULT_LOSS_BACKEND, prompt_len=256, completion_len=512, checkpointing=True,
                 expandable_segments=False, searches: pd.DataFrame | None = None):
        self.searches = searches
        self.values = dict(model=model, gpus=gpus, gib=gib, dtype=dtype, lora_r=lora_r, loss_backend=loss_backend,
                           prompt_len=prompt_len, completion_len=completion_len, checkpointing=checkpointing,
                           expandable_segments=expandable_segments)
        self.models = known_model_names()
        if model not in self.models:
            raise ValueError(f"Unknown model {model!r}: use one of {', '.join(self.models)}.")
        self.controls: dict = {}
        self.summary = self.plot = None
        self._w = widget_module()  # None: `show` displays a static summary and figure

    def current(self) -> dict:
        """The panel's values: the controls' where shown, else the ones it was made with."""
        return {k: (self.controls[k].value if k in self.controls else v) for k, v in self.values.items()}

    def config(self) -> tuple[PlannerConfig, float]:
        """The setting the panel shows, as (PlannerConfig, GiB per GPU); a bad value raises ValueError."""
        v = self.current()
        cfg = PlannerConfig(model=v["model"], loss_backend=v["loss_backend"], dtype=v["dtype"],
                            lora_r=int(v["lora_r"]), world_size=int(v["gpus"]), fsdp=True,
                            prompt_len=int(v["prompt_len"]), completion_len=int(v["completion_len"]),
                            gradient_checkpointing=bool(v["checkpointing"]),
                            expandable_segments=bool(v["expandable_segments"]))
        if not float(v["gib"]) > 0:
            raise ValueError(f"GiB per GPU must be positive, got {v['gib']}")
        return cfg, float(v["gib"])

    def render(self):
        """(summary HTML, figure) of the current setting."""
        cfg, gib = self.config()
        return summary_html(cfg, gib), world_size_figure(cfg, gib, self.searches)

    def show(self):
        from IPython.display import HTML, display

        if self._w is None:
            text, fig = self.render()
            display(HTML(text))
            display(_png(fig))
            return self
        self._build()
        display(self.box)
        self.update()
        return self

    def _build(self):
        w, v = self._w, self.values
        style = {"description_width": f"{label_width_px(LABELS.values())}px"}
        box = w.Layout(width="330px")

        num, choice, tick = w.BoundedIntText, w.Dropdown, w.Checkbox
        kinds = {"model": (choice, dict(options=list(self.models))), "gpus": (num, dict(min=1, max=64)),
                 "gib": (w.BoundedFloatText, dict(min=0.1, max=4096)),
                 "dtype": (choice, dict(options=["bf16", "fp32"])), "lora_r": (num, dict(min=0, max=1024)),
                 "loss_backend": (choice, dict(options=list(DISPLAY_ORDER))),
                 "prompt_len": (num, dict(min=1, max=2**17)), "completion_len": (num, dict(min=1, max=2**17)),
                 "checkpointing": (tick, {}), "expandable_segments": (tick, {})}
        self.controls = {name: kind(value=v[name], description=LABELS[name], style=style, layout=box, **extra)
                         for name, (kind, extra) in kinds.items()}
        self.summary, self.plot = w.HTML(), w.Output()
        for c in self.controls.values():
            c.observe(lambda _change: self.update(), names="value")
        names = list(self.controls)
        rows = [w.HBox([self.controls[n] for n in names[i:i + 3]]) for i in range(0, len(names), 3)]
        self.box = w.VBox([*rows, self.summary, self.plot])

    def update(self):
        """Redraw the summary and the plot for the controls' values (a refused setting: its message instead)."""
        from IPython.display import display

        try:
            text, fig = self.render()
        except ValueError as e:  # a setting the planner refuses: say so in the panel, no traceback
            self.summary.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
            return
        self.summary.value = text
        image = _png(fig)
        self.plot.clear_output(wait=True)
        with self.plot:
            display(image)


def _png(fig):
    """The figure as an IPython Image (closed afterwards: the panel redraws often)."""
    import matplotlib.pyplot as plt
    from IPython.display import Image

    try:
        return Image(data=fig_to_png(fig, dpi=90))
    finally:
        plt.close(fig)


def searches_against_planner(searches: pd.DataFrame | None) -> pd.DataFrame:
    """Each finished search of `searches` (committed or just measured, any device or world size) against the
    planner's max batch for it: the planner's own error wherever it has been measured."""
    if searches is None or searches.empty:
        return pd.DataFrame()
    rows = pd.DataFrame(max_batch_rows(searches))
    if rows.empty:
        return rows
    return rows[["model", "backend", "device", "allocator", "world_size", "budget_gib", "measured_max_batch",
                 "first_oom", "predicted_max_batch", "error_pct", "within_one_step"]].round(
        {"error_pct": 1, "budget_gib": 2})


__all__ = ["PlannerPanel", "searches_against_planner", "summary_html", "with_committed_searches",
           "world_size_figure"]
