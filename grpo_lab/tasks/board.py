"""`BoardCallback`: feeds the notebooks' `LiveBoard` (grpo_lab.lab.live_board) from a transformers / TRL trainer."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from grpo_lab.lab.live_board import LiveBoard


class BoardCallback(TrainerCallback):
    """One board update per logged step (`logging_steps=1`), each also kept in `rows`; `keys` maps board keys
    to log keys; `step_time` is filled from the wall clock if the logs have none."""

    def __init__(self, board: LiveBoard | None, keys: dict[str, str]):
        self.board, self.keys = board, keys
        self.rows: list[dict] = []
        self._t = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "train_runtime" in logs:  # the end-of-training summary, not a step
            return
        values = {board_key: logs.get(log_key) for board_key, log_key in self.keys.items()}
        if "step_time" in self.keys and values.get("step_time") is None and self._t is not None:
            values["step_time"] = time.perf_counter() - self._t
        self.record(state.global_step, values)

    def record(self, step: int, values: dict) -> None:
        """A logged step's values (board key -> value): a row, and a board update when there is a board."""
        self.rows.append({"step": step} | values)
        if self.board is not None:
            self.board.update(step, **values)
