"""Hyperparameter sweeps on one shared replica pool: a grid of `grpo-lab async-loop` settings, every point a run
joining the pool as a tenant (`config`: `SweepConfig`, the YAML grid; `grid`: the runs and their names; `process`:
one run's child process; `figures`: its metrics, curves and pool share; `runner`: `Sweep`; `command`:
`grpo-lab sweep`). See docs/shared_pool.md, "Sweeps"."""

from .config import SweepConfig, SweepError

__all__ = ["Sweep", "SweepConfig", "SweepError"]


def __getattr__(name):
    if name == "Sweep":  # the runner imports the loop's recorder (transformers): only when asked for
        from .runner import Sweep

        return Sweep
    raise AttributeError(name)
