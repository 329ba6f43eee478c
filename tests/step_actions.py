"""A trainer callback the loop tests inject faults with: run an action once, at the end of a given optimizer step
(between two weight syncs), so a fault lands at the same point of the run every time."""

from __future__ import annotations

from transformers import TrainerCallback


class AtStep(TrainerCallback):
    """Run `action` once, at the end of optimizer step `step`."""

    def __init__(self, step: int, action):
        self.step, self.action, self.done = step, action, False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.done:
            self.done = True
            self.action()
