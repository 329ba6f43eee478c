from types import SimpleNamespace

import pytest

from grpo_lab.tasks.board import BoardCallback, LiveBoard, Series, rolling_mean


@pytest.mark.parametrize("mode", ["widgets", "handle", "print"])
def test_board_modes_update_and_render(mode, capsys):
    b = LiveBoard([Series("reward", rolling=3), "loss"], total=4, title="t", mode=mode, redraw_every_s=0.0)
    for g in ("a", "b"):
        b.set_group(g)
        for s in (1, 2):
            b.update(s, reward=0.1 * s, loss=None if s == 1 else 0.5)
    assert b.done == 4 and b.data["a"]["reward"] == [(1.0, 0.1), (2.0, 0.2)]
    png = b.close()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    if mode == "widgets":
        assert b._bar.value == 4 and "4/4" in b._status.value


def test_rolling_mean():
    assert rolling_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_callback_feeds_board():
    b = LiveBoard(["reward", "step_time"], total=2, mode="print")
    cb = BoardCallback(b, keys={"reward": "reward", "step_time": "step_time"})
    st = SimpleNamespace(global_step=1)
    cb.on_step_begin(None, st, None)
    cb.on_log(None, st, None, logs={"reward": 0.5})
    cb.on_log(None, st, None, logs={"train_runtime": 3.0})
    assert b.data[""]["reward"] == [(1.0, 0.5)] and len(b.data[""]["step_time"]) == 1 and b.done == 1
