"""What a sweep is: loop settings shared by every run, a grid of values to try, the pool the runs share, where
everything is written and how many runs train at once (`SweepConfig`, also read from a small YAML file).

    base: {max_steps: 20, prompts_per_step: 1}
    grid: {learning_rate: [1e-3, 3e-3], max_staleness: [1, 2]}
    replicas: 2          # a pool of 2 replicas started by the sweep; or pool_url + pool_admin_key_file
    parallel: 4

Every name in `base` and `grid` is a `grpo-lab async-loop` setting (`async_loop.loop_settings.LoopSettings`, the
fields `trainer_values()` hands to the trainer among them), except those the sweep sets itself for each run
(`SWEEP_OWNED`: its folder, its name, the pool it joins). A mistake is one line (`SweepError`), which
`grpo-lab sweep` turns into exit status 2.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from ..async_loop.loop_settings import LoopSettings, PoolSettings
from ..lab.settings import Range, SettingError, check_fields, setting, without_none

# LoopSettings fields a sweep sets for each run (its folder, name, pool and stores: one per run), or that describe
# replicas a tenant run never starts.
SWEEP_OWNED = ("output_dir", "resume", "overwrite", "run_name", "pool_run", "router_url", "pool_admin_key_file",
               "replica_url", "port", "replicas", "replica_kind", "replica_threads", "launcher", "ray_address",
               "replica_resources", "replica_spread", "replicas_on_trainer_node", "adapter_storage", "checkpoint_storage")


# PoolConfig fields a sweep sets itself for the pool it starts (its own fields, or the pool's folder and key).
POOL_OWNED = ("replicas", "adapter_slots", "lease_s", "state_dir", "admin_key_file")


class SweepError(ValueError):
    """A sweep's settings or grid file refused, in one line (the command's exit status 2)."""


def grid_settings() -> list[str]:
    """The settings a sweep's `base` and `grid` may name: the loop's, less those the sweep sets itself."""
    return [f.name for f in fields(LoopSettings) if f.name not in SWEEP_OWNED]


def check_names(where: str, names) -> None:
    """Refuse a name that is not a setting a sweep may vary (one line naming the valid ones)."""
    valid = grid_settings()
    for name in names:
        if name in SWEEP_OWNED:
            raise SweepError(f"{where}: {name} is set by the sweep for each run")
        if name not in valid:
            raise SweepError(f"{where}: unknown setting {name!r}; valid: {', '.join(valid)}")


def as_setting_value(name: str, value):
    """`value` for the loop setting `name`, where YAML read a number as text (`1e-3` is a string to YAML 1.1)."""
    if isinstance(value, str) and without_none(typing.get_type_hints(LoopSettings)[name]) is float:
        try:
            return float(value)
        except ValueError:
            return value
    return value


def check_pool_names(pool: dict) -> None:
    """Refuse a `pool` key that is not a `PoolConfig` field the sweep leaves to the user, or a value its rule
    refuses (one line)."""
    from ..async_loop.serve_pool import PoolConfig

    valid = [f.name for f in fields(PoolConfig) if f.name not in POOL_OWNED]
    for name in pool:
        if name in POOL_OWNED:
            raise SweepError(f"pool: {name} is set by the sweep (its own key for it, or the pool's folder)")
        if name not in valid:
            raise SweepError(f"pool: unknown setting {name!r}; valid: {', '.join(valid)}")
    try:
        PoolConfig(**pool)  # its values, by the pool's own rules
    except ValueError as error:
        raise SweepError(f"pool: {error}") from None


@dataclass
class SweepConfig:
    """A sweep of `grpo-lab async-loop` runs sharing one replica pool.

    Args:
        base: loop settings every run has (`LoopSettings` field names, e.g. `{"max_steps": 20}`).
        grid: setting name -> the values to try; every combination is one run, named after its values.
        replicas: replicas of the pool the sweep starts (ignored with `pool_url`).
        pool: more `PoolConfig` fields for the pool the sweep starts, e.g. `{"replica_kind": "vllm"}` on a GPU
            (its model is `base`'s `model` unless given here).
        pool_url: an existing pool (`grpo-lab serve-pool`) to join instead of starting one.
        pool_admin_key_file: that pool's admin key file (with `pool_url`).
        adapter_slots: each replica's adapter slots when the sweep starts the pool; None: enough for `parallel`
            runs of the grid's largest `max_staleness` (`max_staleness + 3` each).
        run_lease: seconds after which a silent (killed) run's adapters are reclaimed by the pool the sweep starts.
        out_dir: the sweep's folder (`sweep.json`, `summary.csv`, each run's folder and log); None:
            `outputs/sweep/<date-time>` (`grpo_lab.lab.outputs`).
        parallel: runs training at once; the others wait their turn.
        stop_timeout_s: how long a stopped run may take to leave the pool before it is killed.
    """

    base: dict = field(default_factory=dict, metadata={"help": "loop settings every run has"})
    grid: dict = field(default_factory=dict, metadata={"help": "setting -> values to try"})
    replicas: int = setting(PoolSettings.replicas, check=Range(1))
    pool_url: str | None = None
    pool_admin_key_file: str | None = None
    pool: dict = field(default_factory=dict, metadata={"help": "more PoolConfig fields for the pool it starts"})
    adapter_slots: int | None = setting(None, check=Range(1))
    run_lease: float = setting(PoolSettings.run_lease, check=Range(0.0, open=True))
    out_dir: str | None = None
    parallel: int = setting(3, check=Range(1))
    stop_timeout_s: float = setting(60.0, check=Range(0.0, open=True))

    def __post_init__(self):
        try:
            check_fields(self)
        except SettingError as error:
            raise SweepError(str(error)) from None
        for what, value in (("base", self.base), ("grid", self.grid), ("pool", self.pool)):
            if not isinstance(value, dict):
                raise SweepError(f"{what} must be a mapping of setting names, got {type(value).__name__}")
        check_pool_names(self.pool)
        check_names("base", self.base)
        check_names("grid", self.grid)
        if not self.grid:
            raise SweepError(f"grid is empty: give at least one setting and its values, e.g. "
                             f"learning_rate: [1e-3, 3e-3]; valid settings: {', '.join(grid_settings())}")
        for name, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise SweepError(f"grid: {name} needs a non-empty list of values, got {values!r}")
            if len(set(map(repr, values))) < len(values):
                raise SweepError(f"grid: {name} lists a value twice: {values!r}")
            if name in self.base:
                raise SweepError(f"{name} is in both base and grid: keep it in one")
            self.grid[name] = [as_setting_value(name, v) for v in values]
        self.base = {name: as_setting_value(name, v) for name, v in self.base.items()}
        if (self.pool_url is None) != (self.pool_admin_key_file is None):
            raise SweepError("pool_url and pool_admin_key_file go together (an existing pool and its admin key)")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> SweepConfig:
        """The sweep a YAML file describes (its keys are this class's fields); `overrides` replace keys, and a
        `base` given there is merged into the file's."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as error:
            raise SweepError(f"{path}: cannot read it ({error.strerror or error})") from None
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise SweepError(f"{path} is not valid YAML{at}: {getattr(error, 'problem', None) or error}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SweepError(f"{path}: expected a mapping with a grid (e.g. grid: {{learning_rate: [1e-3, 3e-3]}}), "
                             f"got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in data if key not in known]
        if unknown:
            raise SweepError(f"{path}: unknown key {unknown[0]!r}; valid keys: {', '.join(known)}")
        base = data.get("base") or {}
        if isinstance(base, dict):
            base = {**base, **overrides.pop("base", {})}
        try:
            return cls(**{**data, **overrides, "base": base})
        except SweepError as error:
            raise SweepError(f"{path}: {error}") from None
