"""A live training board from core widgets: a progress line, a status line and throttled matplotlib redraws.

Generic: a list of series (one panel each, optionally with a rolling mean) and a progress bar. Built from core
ipywidgets only (HTML, IntProgress, Output, VBox) so it works on ipywidgets 7.7 (Colab) and 8.x; without a
widget frontend it falls back to an IPython display handle, and without IPython to printed lines. Plots are
re-rendered as PNG at most every `redraw_every_s` seconds (always on `close()`). `BoardCallback` feeds it
from a transformers/TRL `Trainer`.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import TrainerCallback


@dataclass
class Series:
    key: str                      # the key in the update dict / trainer logs
    label: str | None = None      # panel title
    rolling: int = 0              # draw a rolling mean over this many points too (0: off)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and getattr(ip, "kernel", None) is not None
    except Exception:  # noqa: BLE001
        return False


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


class LiveBoard:
    """`board.update(step, key=value, ...)`; `board.close()` draws the final figure and returns its PNG bytes."""

    def __init__(self, series: Sequence[Series | str], total: int, title: str = "", redraw_every_s: float = 2.0,
                 group_key: str | None = None, mode: str = "auto", ncols: int = 3):
        self.series = [s if isinstance(s, Series) else Series(s) for s in series]
        self.total, self.title, self.redraw_every_s, self.ncols = max(int(total), 1), title, redraw_every_s, ncols
        self.group = None                    # current group (e.g. backend); one line per group in every panel
        self.data: dict[str, dict[str, list[tuple[float, float]]]] = {}
        self.done, self._last_draw, self._t0 = 0, 0.0, time.perf_counter()
        self.mode = ("widgets" if _in_kernel() else "print") if mode == "auto" else mode
        self._widgets = self._handle = None
        self._open()

    # --- display back-ends -------------------------------------------------------------------------------
    def _open(self):
        if self.mode == "widgets":
            try:
                import ipywidgets as w
                from IPython.display import display

                self._bar = w.IntProgress(value=0, min=0, max=self.total, description="step")
                self._status = w.HTML(value=f"<b>{self.title}</b>")
                self._out = w.Output()
                self._widgets = w.VBox([self._status, self._bar, self._out])
                display(self._widgets)
                return
            except Exception:  # noqa: BLE001 - no widget frontend: use a display handle
                self.mode = "handle"
        if self.mode == "handle":
            try:
                from IPython.display import HTML, display

                self._handle = display(HTML(self._status_html()), display_id=True)
                self._img_handle = display(HTML(""), display_id=True)
                return
            except Exception:  # noqa: BLE001
                self.mode = "print"

    def _status_html(self) -> str:
        el = time.perf_counter() - self._t0
        rate = self.done / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        pct = 100.0 * self.done / self.total
        last = []
        for s in self.series:
            pts = self.data.get(self.group or "", {}).get(s.key)
            if pts:
                last.append(f"{s.label or s.key} {pts[-1][1]:.4g}")
        head = f"<b>{self.title}</b> " if self.title else ""
        grp = f"[{self.group}] " if self.group else ""
        return (f"{head}{grp}{self.done}/{self.total} ({pct:.0f}%) | {el:.0f}s elapsed, ETA {eta:.0f}s | "
                + " | ".join(last))

    # --- data --------------------------------------------------------------------------------------------
    def set_group(self, name: str, total: int | None = None):
        """Start a new line (e.g. the next backend); the progress bar counts over all groups."""
        self.group = name
        if total is not None:
            self.total = max(int(total), 1)
            if self._widgets is not None:
                self._bar.max = self.total

    def update(self, step: float, advance: int = 1, **values):
        grp = self.data.setdefault(self.group or "", {})
        for k, v in values.items():
            if v is not None:
                grp.setdefault(k, []).append((float(step), float(v)))
        self.done = min(self.done + advance, self.total)
        if self._widgets is not None:
            self._bar.value = self.done
            self._status.value = self._status_html()
        elif self._handle is not None:
            from IPython.display import HTML

            self._handle.update(HTML(self._status_html()))
        now = time.perf_counter()
        if self.mode != "print" and now - self._last_draw >= self.redraw_every_s:
            self._last_draw = now
            self._show(self.render_png())
        elif self.mode == "print" and (self.done % max(self.total // 10, 1) == 0 or self.done == self.total):
            print(self._status_html().replace("<b>", "").replace("</b>", ""), flush=True)

    def render_png(self, dpi: int = 80) -> bytes:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        n = len(self.series)
        ncols = min(self.ncols, n)
        nrows = (n + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.8 * nrows), squeeze=False)
        for ax, s in zip(axes.flat, self.series, strict=False):
            for gname, grp in self.data.items():
                pts = grp.get(s.key)
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                line, = ax.plot(xs, ys, lw=0.8, alpha=0.45 if s.rolling else 1.0, label=gname or None)
                if s.rolling:
                    ax.plot(xs, rolling_mean(ys, s.rolling), lw=1.8, color=line.get_color())
            ax.set_title(s.label or s.key, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        if len(self.data) > 1:
            axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        plt.close(fig)
        return buf.getvalue()

    def _show(self, png: bytes):
        from IPython.display import Image, display

        if self._widgets is not None:
            self._out.clear_output(wait=True)
            with self._out:
                display(Image(png))
        elif self._handle is not None:
            self._img_handle.update(Image(png))

    def close(self) -> bytes:
        png = self.render_png()
        if self.mode != "print":
            self._show(png)
        return png


class BoardCallback(TrainerCallback):
    """Feeds a LiveBoard from trainer logs (`logging_steps=1`); `keys` maps board keys to log keys."""

    def __init__(self, board: LiveBoard, keys: dict[str, str] | None = None, step_offset: int = 0):
        self.board, self.keys, self.step_offset = board, keys, step_offset
        self._t = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "train_runtime" in logs:          # the end-of-training summary, not a step
            return
        keys = self.keys or {s.key: s.key for s in self.board.series}
        vals = {bk: logs.get(lk) for bk, lk in keys.items()}
        if "step_time" in keys and vals.get("step_time") is None and self._t is not None:
            vals["step_time"] = time.perf_counter() - self._t
        self.board.update(state.global_step + self.step_offset, **vals)
