"""The live board works with ipywidgets (7.7 / 8.x core widgets) and falls back without a kernel."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo_lab import widgets  # noqa: E402


def test_board_without_a_kernel_prints(capsys):
    board = widgets.LiveBoard("t", total=2, min_interval_s=0)
    assert not board.use_widgets
    board.show()
    board.step("first")
    fig = plt.figure()
    assert board.figure(fig) is True
    board.done("ok")
    plt.close(fig)
    assert "[1/2] first" in capsys.readouterr().out


def test_board_with_core_widgets_throttles():
    board = widgets.LiveBoard("t", total=3, min_interval_s=60, use_widgets=True)
    board._display = lambda *a, **k: None
    fig = plt.figure()
    assert board.figure(fig) is True
    assert board.figure(fig) is False  # throttled: kept as pending
    board.step("x")
    assert board.progress.value == 1 and board.progress.max == 3
    board.done()
    assert board._pending is None
    plt.close(fig)


def test_png_roundtrip():
    fig = plt.figure()
    assert widgets.fig_to_png(fig)[:4] == b"\x89PNG"
    plt.close(fig)


def test_param_form_shows_bad_input_as_a_message(monkeypatch):
    monkeypatch.setattr(widgets, "_ipython_display", lambda: (lambda *a, **k: None))
    seen = {}

    def on_run(values):
        seen.update(values)
        raise ValueError("batch sizes must be positive integers, got 'x'.")

    form = widgets.ParamForm({"model": "tiny-qwen3", "batch_sizes": [2, 4], "quick": True, "prompt_len": 8},
                             on_run=on_run)
    assert set(form.controls) == {"model", "batch_sizes", "quick", "prompt_len"}
    form.controls["batch_sizes"].value = "2,x"
    form._clicked(None)
    assert seen["batch_sizes"] == "2,x" and seen["quick"] is True and seen["prompt_len"] == 8
    assert "positive integers" in form.message.value
