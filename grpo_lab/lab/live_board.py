"""The one live board of the notebooks: a status line with progress and ETA, a progress bar and a plot area.

Core ipywidgets only (Colab's 7.7 and 8.x, no ipympl), else IPython display handles, else printed lines; plots are
PNGs redrawn at most every `redraw_every_s` (the last always, by `done`/`close`). Two ways to feed it, mixed at will:

    board = LiveBoard("Peak memory vs batch size", total=24).show()
    board.step("B=8 naive"); board.figure(fig)          # a figure the caller draws
    board.done("24 points")

    board = LiveBoard("GRPO", total=100, series=[Series("reward", rolling=10), "loss"])
    board.set_group("grpo_lab"); board.update(step, reward=0.4, loss=0.1)   # one panel per series, a line per group
    png = board.close()
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import io
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

MODES = ("auto", "widgets", "handle", "print")


@dataclass
class Series:
    """One panel of a series board: `key` in the update values / trainer logs, a title, an optional rolling mean."""

    key: str
    label: str | None = None
    rolling: int = 0


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over `window` points (shorter at the start)."""
    sums = [0.0, *itertools.accumulate(values)]
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def fig_to_png(fig, dpi: int = 90) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def ipython_shell():
    """The running IPython shell, or None (plain Python, or IPython not installed)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def display_frontend() -> str:
    """`widgets` in a kernel with ipywidgets, `handle` in IPython without them, else `print`."""
    shell = ipython_shell()
    if shell is None:
        return "print"
    if getattr(shell, "kernel", None) is None or importlib.util.find_spec("ipywidgets") is None:
        return "handle"
    return "widgets"


class LiveBoard:
    """Title, status (done/total, elapsed, ETA, the latest series values), progress bar, plot area.

    Args:
        title: shown in bold at the top.
        total: units of work (`step`/`update` advance it); `set_total` changes it.
        series: panels drawn from `update(...)` values (`Series` or plain keys); empty for a caller-drawn board.
        redraw_every_s: at most one plot redraw this often.
        mode: `auto`, `widgets`, `handle` (IPython display handles) or `print`.
        ncols: panels per row of the series figure.
        unit: the progress bar's label (e.g. "step").
    """

    def __init__(self, title: str = "", total: int = 1, series: Sequence[Series | str] = (), *,
                 redraw_every_s: float = 1.0, mode: str = "auto", ncols: int = 3, unit: str = ""):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.title, self.total, self.value = title, max(1, int(total)), 0
        self.series = [s if isinstance(s, Series) else Series(s) for s in series]
        self.redraw_every_s, self.ncols, self.unit = redraw_every_s, ncols, unit
        self.mode = display_frontend() if mode == "auto" else mode
        self.group: str | None = None  # the current line (e.g. the backend); one line per group in every panel
        self.data: dict[str, dict[str, list[tuple[float, float]]]] = {}
        self.text = ""
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._pending = None  # a caller's figure held back by the throttle
        self._shown = False
        self._handles: dict = {}
        self._printed_at = -1

    # -- display -------------------------------------------------------------------------------------------------
    def show(self) -> "LiveBoard":
        """Put the board in the output (once); called by the first status or update if the caller did not."""
        if self._shown:
            return self
        self._shown = True
        if self.mode == "widgets":
            try:
                import ipywidgets as w
                from IPython.display import display

                self.header = w.HTML(value=self._header_html())
                self.progress = w.IntProgress(value=self.value, min=0, max=self.total, description=self.unit)
                self.plot = w.Output()
                display(w.VBox([self.header, self.progress, self.plot]))
                return self
            except Exception:  # noqa: BLE001 - no widget frontend after all
                self.mode = "handle"
        if self.mode == "handle":
            with contextlib.suppress(Exception):
                from IPython.display import HTML, display

                for part, body in (("header", self._header_html()), ("plot", "")):
                    self._handles[part] = display(HTML(body), display_id=True)
                if None not in self._handles.values():  # display() returns no handle outside IPython
                    return self
            self.mode = "print"
        return self

    def _status_line(self) -> str:
        elapsed = time.perf_counter() - self._t0
        rate = self.value / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {(self.total - self.value) / rate:.0f}s" if 0 < self.value < self.total and rate > 0 else ""
        now = self.data.get(self.group or "", {})  # the current group's points
        latest = [f"{s.label or s.key} {now[s.key][-1][1]:.4g}" for s in self.series if now.get(s.key)]
        group = f"[{self.group}] " if self.group else ""
        parts = [f"{group}{self.value}/{self.total} ({100.0 * self.value / self.total:.0f}%), {elapsed:.0f}s{eta}"]
        return " | ".join(parts + ([self.text] if self.text else []) + latest)

    def _header_html(self) -> str:
        head = f"<b>{html.escape(self.title)}</b> &nbsp; " if self.title else ""
        return f"{head}<span>{html.escape(self._status_line())}</span>"

    def _refresh(self, announce: bool) -> None:
        self.show()
        if self.mode == "widgets":
            self.header.value = self._header_html()
            self.progress.max, self.progress.value = self.total, min(self.value, self.total)
        elif self.mode == "handle":
            from IPython.display import HTML

            self._handles["header"].update(HTML(self._header_html()))
        elif announce:
            title = f"{self.title}: " if self.title else ""
            print(f"{title}{self._status_line()}", flush=True)

    # -- progress ------------------------------------------------------------------------------------------------
    def set_total(self, total: int) -> None:
        self.total = max(1, int(total))
        self._refresh(announce=False)

    def set_group(self, name: str) -> None:
        """Start a new line in every panel (e.g. the next backend); the progress counts over all groups."""
        self.group = name

    def status(self, text: str) -> None:
        self.text = text
        self._refresh(announce=True)

    def step(self, text: str = "", n: int = 1) -> None:
        self.value = min(self.value + n, self.total)
        self.status(text)

    def update(self, step: float, advance: int = 1, **values) -> None:
        """Record `values` at `step` for the current group, advance the progress, redraw the panels if due."""
        group = self.data.setdefault(self.group or "", {})
        for key, v in values.items():
            if v is not None:
                group.setdefault(key, []).append((float(step), float(v)))
        self.value = min(self.value + advance, self.total)
        tenth = self.value * 10 // self.total  # in print mode, one line per tenth of the run
        self._refresh(announce=tenth != self._printed_at)
        self._printed_at = tenth
        if self.mode != "print" and self.series and time.perf_counter() - self._last_draw >= self.redraw_every_s:
            self._show_png(self.render_png())

    def done(self, text: str = "done") -> None:
        self.value = self.total
        self.status(text)
        if self._pending is not None:
            self._draw(self._pending)

    # -- plot --------------------------------------------------------------------------------------------------
    def figure(self, fig, force: bool = False) -> bool:
        """Show a caller's `fig`, at most once per `redraw_every_s` unless `force` (the last one is kept for
        `done`). Returns whether it was drawn now."""
        if not force and time.perf_counter() - self._last_draw < self.redraw_every_s:
            self._pending = fig
            return False
        self._draw(fig)
        return True

    def _draw(self, fig) -> None:
        self._pending = None
        self._show_png(fig_to_png(fig))

    def _show_png(self, png: bytes) -> None:
        """Replace what the plot area shows with `png` (nothing in print mode)."""
        self._last_draw = time.perf_counter()
        self.show()
        if self.mode == "print":
            return
        from IPython.display import Image, display

        if self.mode == "widgets":
            with self.plot:
                self.plot.clear_output(wait=True)
                display(Image(data=png))
        else:
            self._handles["plot"].update(Image(data=png))

    def render_png(self, dpi: int = 80) -> bytes:
        """The series panels as one PNG: a line per group, with the rolling mean where a series asks for one."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        n = max(len(self.series), 1)
        ncols = min(self.ncols, n)
        nrows = (n + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.8 * nrows), squeeze=False)
        for ax, s in zip(axes.flat, self.series, strict=False):
            for name, group in self.data.items():
                points = group.get(s.key)
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                line, = ax.plot(xs, ys, lw=0.8, alpha=0.45 if s.rolling else 1.0, label=name or None)
                if s.rolling:
                    ax.plot(xs, rolling_mean(ys, s.rolling), lw=1.8, color=line.get_color())
            ax.set_title(s.label or s.key, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(self.series):]:
            ax.axis("off")
        if len(self.data) > 1 and self.series:
            axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        png = fig_to_png(fig, dpi=dpi)
        plt.close(fig)
        return png

    def close(self) -> bytes:
        """Draw the final series figure and return it as PNG bytes."""
        png = self.render_png()
        self._show_png(png)
        return png
