"""What a terminal shows of a running loop: a progress bar with ETA and the figures that say which side waits.

On a terminal (stderr a TTY) it is one tqdm bar; in a log file or a CI job, where a bar would be a wall of carriage
returns, it is one plain line per logged step. Either way the run ends with the doctor's verdict, so every run says
which side bounded it and the knob to turn next.
"""

from __future__ import annotations

import sys

from transformers import TrainerCallback

# (log key, label on a line, label beside the bar, format): the figures that say whether the loop is healthy and
# which side waits. The bar's labels are short so that the bar itself keeps its width on an 80-column terminal.
FIGURES = (("reward", "reward", "reward", "{:.3f}"), ("ratio", "ratio", "ratio", "{:.3f}"),
           ("sample/staleness_mean", "staleness", "stale", "{:.1f}"), ("perf/step_s", "step", "step", "{:.2f}s"),
           ("perf/rollout_wait_s", "rollout wait", "wait", "{:.2f}s"),
           ("sample/rollout_queue_size", "queue", None, "{:.0f}"))


def figures(logs: dict, short: bool = False) -> dict[str, str]:
    return {(brief if short else label): fmt.format(logs[key]) for key, label, brief, fmt in FIGURES
            if isinstance(logs.get(key), (int, float)) and (brief or not short)}


class LoopProgress(TrainerCallback):
    """A tqdm bar over the run's steps (starting at the resumed step), or a line per step when not on a TTY."""

    bar = None  # the tqdm bar, while a run on a terminal trains

    def on_train_begin(self, args, state, control, **kwargs):
        if sys.stderr.isatty() and state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, unit="step", file=sys.stderr,
                            dynamic_ncols=True, desc="async loop",
                            bar_format="{desc} {percentage:3.0f}%|{bar:12}| {n_fmt}/{total_fmt} "
                                       "[{elapsed}<{remaining}]{postfix}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        if self.bar is not None:
            self.bar.set_postfix(figures(logs, short=True), refresh=False)
            self.bar.update(state.global_step - self.bar.n)
        else:
            parts = ", ".join(f"{label} {value}" for label, value in figures(logs).items())
            print(f"step {state.global_step}/{state.max_steps}: {parts}", file=sys.stderr, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def verdict_lines(verdict) -> list[str]:
    """The doctor's verdict as the few lines that end every run."""
    lines = [f"doctor: {verdict.headline}"]
    lines += [f"  {i}. {knob}" for i, knob in enumerate(verdict.knobs, 1)]
    lines += [f"  note: {note}" for note in verdict.notes]
    return lines
