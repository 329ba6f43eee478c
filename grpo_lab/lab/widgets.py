"""Parameter forms for the notebooks from core ipywidgets only, so they work on Colab's ipywidgets 7.7 and on 8.x;
without a widget frontend a form shows nothing and `values()` returns the parameters unchanged.

    form = ParamForm({"model": "Qwen3-0.6B", "batch_sizes": "4,8,16", "quick": True}, on_run=callback)
    form.show()
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable

from .live_board import ipython_shell

try:
    import ipywidgets as _w
except ImportError:  # pragma: no cover - exercised by the fallback test via monkeypatch
    _w = None


def _ipython_display():
    if ipython_shell() is None:
        return None
    from IPython.display import display

    return display


def widget_module():
    """ipywidgets when there is a kernel to show them in, else None."""
    return _w if _ipython_display() is not None else None


CHAR_PX = 8  # a generous average width of a 13 px UI font character, so labels and values are never cut


def label_width_px(labels) -> int:
    """One description width for a whole form (aligned, and wide enough that ipywidgets does not cut a label)."""
    return max(80, CHAR_PX * max((len(t) for t in labels), default=0) + 16)


def text_width_px(text: str, min_chars: int = 24, max_chars: int = 90) -> int:
    """A text box wide enough to show `text` whole (up to max_chars), so a list of models is readable."""
    return CHAR_PX * min(max(len(text) + 2, min_chars), max_chars) + 16


class ParamForm:
    """One control per parameter (bool → Checkbox, int → IntText, float → FloatText, str/list → Text, a tuple of
    choices → Dropdown) and a Run button calling `on_run(values)`; errors show in the form, not as a traceback.

    With `output=True` the form has an Output area under its button, cleared at each run, where whatever `on_run`
    displays or prints appears: a button's callback runs outside any cell, so without it JupyterLab sends that
    output to its log console, not to the notebook."""

    def __init__(self, params: dict, on_run: Callable[[dict], None], choices: dict | None = None,
                 button: str = "Run on this machine", output: bool = False):
        self.on_run = on_run
        self.output = None
        self.params = dict(params)
        self.choices = choices or {}
        self._display = _ipython_display()
        self.controls = {}
        if _w is None or self._display is None:
            return
        label_px = label_width_px([name.replace("_", " ") for name in self.params])
        numbers = {bool: _w.Checkbox, int: _w.IntText, float: _w.FloatText}
        for name, value in self.params.items():
            kw = {"description": name.replace("_", " "), "style": {"description_width": f"{label_px}px"}}
            if name in self.choices:
                c = _w.Dropdown(options=list(self.choices[name]), value=value, **kw)
            elif type(value) in numbers:
                c = numbers[type(value)](value=value, **kw)
            else:
                text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
                c = _w.Text(value=text, layout=_w.Layout(width=f"{label_px + text_width_px(text)}px"), **kw)
            self.controls[name] = c
        self.button = _w.Button(description=button, button_style="primary", layout=_w.Layout(width="auto"))
        self.message = _w.HTML(value="")
        self.button.on_click(self._clicked)
        self.output = _w.Output() if output else None
        self.box = _w.VBox(list(self.controls.values()) + [_w.HBox([self.button, self.message])]
                           + ([self.output] if self.output is not None else []))

    def values(self) -> dict:
        return {k: c.value for k, c in self.controls.items()} if self.controls else dict(self.params)

    def _clicked(self, _):
        self.message.value = "<i>running…</i>"
        try:
            if self.output is not None:
                self.output.clear_output()
            with contextlib.nullcontext() if self.output is None else self.output:
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
