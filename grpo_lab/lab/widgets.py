"""A live board for notebooks from core ipywidgets only (HTML, IntProgress, Output, VBox/HBox, Button, Text,
Checkbox), so it works on Colab's ipywidgets 7.7 and on 8.x, with matplotlib figures redrawn as PNG at most every
`min_interval_s` (no ipympl). Without ipywidgets, or outside a kernel, it falls back to IPython display handles
(`display(..., display_id=True)` then `.update`), and with no IPython at all to printing.

    board = LiveBoard("Peak memory vs batch size", total=24)
    board.show()
    for i, row in enumerate(rows):
        board.step(f"B={row['batch_size']} {row['backend']}")
        board.figure(make_fig(...))          # throttled
    board.figure(fig, force=True); board.done("24 points")
    form = ParamForm({"model": "Qwen3-0.6B", "batch_sizes": "4,8,16", "quick": True}, on_run=callback)
    form.show()
"""

from __future__ import annotations

import html
import io
import time
from collections.abc import Callable

try:
    import ipywidgets as _w
except ImportError:  # pragma: no cover - exercised by the fallback test via monkeypatch
    _w = None


def _ipython_display():
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is None:
            return None
        return display
    except ImportError:
        return None


def fig_to_png(fig, dpi: int = 90) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


class LiveBoard:
    """Title + status line + progress bar + a plot area (+ an optional table area)."""

    def __init__(self, title: str = "", total: int = 1, min_interval_s: float = 1.0, use_widgets: bool | None = None):
        self.title = title
        self.total = max(1, int(total))
        self.value = 0
        self.min_interval_s = min_interval_s
        self._last_draw = 0.0
        self._pending = None
        self._display = _ipython_display()
        self.use_widgets = (_w is not None and self._display is not None) if use_widgets is None else use_widgets
        self._handles: dict = {}
        if self.use_widgets:
            self.header = _w.HTML(value=self._header_html(""))
            self.progress = _w.IntProgress(value=0, min=0, max=self.total, description="")
            self.plot = _w.Output()
            self.table = _w.Output()
            self.box = _w.VBox([self.header, self.progress, self.plot, self.table])

    # -- display -------------------------------------------------------------------------------------------------
    def _header_html(self, status: str) -> str:
        return (f"<b>{html.escape(self.title)}</b> &nbsp; <span>{html.escape(status)}</span>"
                f" &nbsp; <small>{self.value}/{self.total}</small>")

    def show(self):
        if self.use_widgets:
            self._display(self.box)
        elif self._display is not None:
            from IPython.display import HTML

            self._handles["header"] = self._display(HTML(self._header_html("")), display_id=True)
            self._handles["plot"] = self._display(HTML(""), display_id=True)
            self._handles["table"] = self._display(HTML(""), display_id=True)
        return self

    def set_total(self, total: int):
        self.total = max(1, int(total))
        if self.use_widgets:
            self.progress.max = self.total

    def status(self, text: str):
        if self.use_widgets:
            self.header.value = self._header_html(text)
            self.progress.value = min(self.value, self.total)
        elif "header" in self._handles:
            from IPython.display import HTML

            self._handles["header"].update(HTML(self._header_html(text)))
        else:
            print(f"[{self.value}/{self.total}] {text}", flush=True)

    def step(self, text: str = "", n: int = 1):
        self.value += n
        self.status(text)

    def done(self, text: str = "done"):
        self.value = self.total
        self.status(text)
        if self._pending is not None:
            self._draw(self._pending)

    # -- plot / table --------------------------------------------------------------------------------------------
    def figure(self, fig, force: bool = False):
        """Show `fig` as a PNG, at most once per `min_interval_s` unless `force` (the last one is kept for `done`)."""
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval_s:
            self._pending = fig
            return False
        self._draw(fig)
        return True

    def _draw(self, fig):
        self._pending = None
        self._last_draw = time.monotonic()
        png = fig_to_png(fig)
        if self.use_widgets:
            from IPython.display import Image

            with self.plot:
                self.plot.clear_output(wait=True)
                self._display(Image(data=png))
        elif "plot" in self._handles:
            from IPython.display import Image

            self._handles["plot"].update(Image(data=png))

    def show_table(self, df_or_html):
        text = df_or_html if isinstance(df_or_html, str) else df_or_html.to_html()
        if self.use_widgets:
            from IPython.display import HTML

            with self.table:
                self.table.clear_output(wait=True)
                self._display(HTML(text))
        elif "table" in self._handles:
            from IPython.display import HTML

            self._handles["table"].update(HTML(text))


CHAR_PX = 8  # a generous average width of a 13 px UI font character, so labels and values are never cut


def label_width_px(labels) -> int:
    """One description width for a whole form (aligned, and wide enough that ipywidgets does not cut a label)."""
    return max(80, CHAR_PX * max((len(t) for t in labels), default=0) + 16)


def text_width_px(text: str, min_chars: int = 24, max_chars: int = 90) -> int:
    """A text box wide enough to show `text` whole (up to max_chars), so a list of models is readable."""
    return CHAR_PX * min(max(len(text) + 2, min_chars), max_chars) + 16


class ParamForm:
    """One control per parameter (bool → Checkbox, int → IntText, float → FloatText, str/list → Text, a tuple of
    choices → Dropdown) and a Run button calling `on_run(values)`; errors show in the form, not as a traceback."""

    def __init__(self, params: dict, on_run: Callable[[dict], None], choices: dict | None = None,
                 button: str = "Run on this machine"):
        self.on_run = on_run
        self.params = dict(params)
        self.choices = choices or {}
        self._display = _ipython_display()
        self.controls = {}
        if _w is None or self._display is None:
            return
        label_px = label_width_px([name.replace("_", " ") for name in self.params])
        for name, value in self.params.items():
            desc = name.replace("_", " ")
            style = {"description_width": f"{label_px}px"}
            if name in self.choices:
                c = _w.Dropdown(options=list(self.choices[name]), value=value, description=desc, style=style)
            elif isinstance(value, bool):
                c = _w.Checkbox(value=value, description=desc, style=style)
            elif isinstance(value, int):
                c = _w.IntText(value=value, description=desc, style=style)
            elif isinstance(value, float):
                c = _w.FloatText(value=value, description=desc, style=style)
            else:
                text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
                c = _w.Text(value=text, description=desc, style=style,
                            layout=_w.Layout(width=f"{label_px + text_width_px(text)}px"))
            self.controls[name] = c
        self.button = _w.Button(description=button, button_style="primary", layout=_w.Layout(width="auto"))
        self.message = _w.HTML(value="")
        self.button.on_click(self._clicked)
        self.box = _w.VBox(list(self.controls.values()) + [_w.HBox([self.button, self.message])])

    def values(self) -> dict:
        return {k: c.value for k, c in self.controls.items()} if self.controls else dict(self.params)

    def _clicked(self, _):
        self.message.value = "<i>running…</i>"
        try:
            self.on_run(self.values())
            self.message.value = "done"
        except ValueError as e:  # bad input: a clear message, no traceback
            self.message.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
        except Exception as e:  # noqa: BLE001
            self.message.value = f"<span style='color:#b00'>{html.escape(type(e).__name__ + ': ' + str(e))}</span>"
            raise

    def show(self):
        if self.controls:
            self._display(self.box)
        return self
