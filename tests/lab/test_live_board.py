"""The one live board: caller-drawn figures and series panels in every display mode, and its callback."""

from types import SimpleNamespace

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo_lab.lab import live_board  # noqa: E402
from grpo_lab.lab.live_board import LiveBoard, Series, rolling_mean  # noqa: E402
from grpo_lab.tasks.board import BoardCallback  # noqa: E402


@pytest.mark.parametrize("mode", ["widgets", "handle", "print"])
def test_series_board_updates_and_renders_in_every_mode(mode):
    b = LiveBoard("t", total=4, series=[Series("reward", rolling=3), "loss"], mode=mode, redraw_every_s=0.0)
    for g in ("a", "b"):
        b.set_group(g)
        for s in (1, 2):
            b.update(s, reward=0.1 * s, loss=None if s == 1 else 0.5)
    assert b.value == 4 and b.data["a"]["reward"] == [(1.0, 0.1), (2.0, 0.2)]
    assert b.data["a"]["loss"] == [(2.0, 0.5)]  # a None value is not a point
    png = b.close()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    if mode == "widgets":
        assert b.progress.value == 4 and "4/4" in b.header.value


def test_print_mode_reports_progress_eta_and_latest_values(capsys):
    b = LiveBoard("run", total=10, series=["reward"], mode="print")
    for s in range(1, 11):
        b.update(s, reward=s / 10)
    out = capsys.readouterr().out.splitlines()
    assert 2 <= len(out) <= 11  # about one line per tenth, not one per call beyond that
    assert out[-1].startswith("run: 10/10 (100%)") and "reward 1" in out[-1]
    assert any("ETA" in line for line in out[:-1])


def test_caller_figure_board_prints_without_a_kernel(capsys):
    board = LiveBoard("t", total=2, redraw_every_s=0)
    assert board.mode == "print"
    board.show()
    board.step("first")
    fig = plt.figure()
    assert board.figure(fig) is True
    board.done("ok")
    plt.close(fig)
    out = capsys.readouterr().out
    assert "t: 1/2 (50%)" in out and "first" in out and "2/2" in out


def test_caller_figure_is_throttled_and_the_last_one_drawn_at_done(monkeypatch):
    shown = []
    monkeypatch.setattr(LiveBoard, "_show_png", lambda self, png: shown.append(png) or setattr(
        self, "_last_draw", live_board.time.perf_counter()))
    board = LiveBoard("t", total=3, redraw_every_s=60, mode="widgets")
    fig = plt.figure()
    assert board.figure(fig) is True
    assert board.figure(fig) is False  # throttled: kept as pending
    board.step("x")
    assert board.progress.value == 1 and board.progress.max == 3
    board.done()
    assert board._pending is None and len(shown) == 2
    plt.close(fig)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        LiveBoard("t", mode="tty")


def test_png_roundtrip():
    fig = plt.figure()
    assert live_board.fig_to_png(fig)[:4] == b"\x89PNG"
    plt.close(fig)


def test_rolling_mean():
    assert rolling_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_callback_feeds_board():
    b = LiveBoard(series=["reward", "step_time"], total=2, mode="print")
    cb = BoardCallback(b, keys={"reward": "reward", "step_time": "step_time"})
    st = SimpleNamespace(global_step=1)
    cb.on_step_begin(None, st, None)
    cb.on_log(None, st, None, logs={"reward": 0.5})
    cb.on_log(None, st, None, logs={"train_runtime": 3.0})
    assert b.data[""]["reward"] == [(1.0, 0.5)] and len(b.data[""]["step_time"]) == 1 and b.value == 1
