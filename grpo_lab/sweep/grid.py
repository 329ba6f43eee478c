"""A grid expanded into named runs: every combination of the grid's values is one run, named after the values it
varies (`lr3e-3_ms2`), a name that is also a valid pool run name (`serving.tenancy.runs.check_run_name`) and file
name, so a run's pool namespace, folder, log and tracker run all carry it.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass

from ..async_loop.loop_settings import LoopSettings
from ..lab.settings import SettingError
from ..serving.tenancy.runs import MAX_RUN_NAME, check_run_name
from .config import SweepError

_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_-]+|-{2,}")


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its name and the loop settings it has beyond the sweep's own (`base` + its values)."""

    name: str
    settings: dict
    varied: dict  # the grid values that tell it apart (what its name says)


def short(name: str) -> str:
    """A setting's short form in a run name: the initials of its words (`learning_rate` -> `lr`)."""
    return "".join(word[0] for word in name.split("_") if word)


def value_text(value) -> str:
    """A value as it reads in a run name: `3e-3`, `0p5`, `true`, `m1` for -1; other characters (and `--`) become
    `_`. No `.`: the pool allows it in a run name, but the CPU replica (PEFT) refuses an adapter name holding one."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:g}"
        if "." in text and value and abs(value) < 0.1:  # 0.003 -> 3e-3
            mantissa, exponent = f"{value:e}".split("e")
            text = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    else:
        text = str(value)
    text = ("m" + text[1:] if text.startswith("-") else text).replace(".", "p")
    return _NOT_IN_A_NAME.sub("_", text).strip("_-") or "x"


def run_name(varied: dict, labels: dict[str, str] | None = None) -> str:
    """`<label><value>` for each varied setting, joined by `_` (`lr3e-3_ms2`); `labels`: each setting's label
    (default: its initials). A name too long for the pool is cut and ends in a digest of the whole."""
    labels = labels or {name: short(name) for name in varied}
    name = "_".join(f"{labels[key]}{value_text(value)}" for key, value in varied.items()) or "run"
    if len(name) > MAX_RUN_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[:MAX_RUN_NAME - 9].rstrip('_.')}_{digest}"
    return check_name(name)


def check_name(name: str) -> str:
    """`name` if a sweep's run may be called that (SweepError otherwise): the pool's rule, and no `.` (see
    `value_text`)."""
    try:
        check_run_name(name)
    except ValueError as error:
        raise SweepError(str(error)) from None
    if "." in name:
        raise SweepError(f"run name {name!r}: no '.' (the CPU replica cannot load an adapter whose name holds one)")
    return name


def labels_for(names) -> dict[str, str]:
    """Each setting's label in run names: its initials, or its whole name where two settings share initials."""
    names = list(names)
    initials = [short(n) for n in names]
    return {n: (i if initials.count(i) == 1 else n.replace("_", "")) for n, i in zip(names, initials)}


def check_settings(where: str, values: dict) -> LoopSettings:
    """The loop settings `values` give, by `LoopSettings`' own rules (SweepError naming the setting)."""
    try:
        return LoopSettings(**values)
    except SettingError as error:
        raise SweepError(f"{where}: {error}") from None
    except TypeError as error:  # a value of a type the rule cannot even compare
        raise SweepError(f"{where}: {error}") from None


def expand(base: dict, grid: dict) -> list[RunSpec]:
    """Every combination of `grid`'s values on top of `base`, in the grid's order, each checked and named."""
    varying = [name for name, values in grid.items() if len(values) > 1]
    labels = labels_for(varying)
    runs, seen = [], {}
    for combination in itertools.product(*grid.values()):
        point = dict(zip(grid, combination))
        varied = {name: point[name] for name in varying}
        name = run_name(varied, labels)
        if name in seen:
            raise SweepError(f"grid: runs {seen[name]} and {point} would both be named {name!r}; use values that "
                             f"read differently")
        seen[name] = point
        settings = {**base, **point}
        check_settings(f"run {name}", settings)
        runs.append(RunSpec(name, settings, varied))
    return runs
