"""Settings declared once, as documented dataclasses (TRL's `*_config.py` style): each field carries its default,
its help and its rule, and the command line is generated from the class (`settings_parser`).

`setting()` makes such a field; `Range` and `FileName` are rules; `check_fields` checks a whole instance (a value from
Python or a config file has not passed the command line's checks) and `SettingError` names the field at fault.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Literal


class SettingError(ValueError):
    """A setting out of its rule. `str()` names the field; the command line names its flag (`flag`) instead."""

    def __init__(self, name: str, message: str, flag: str | None = None):
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message
        self.flag = flag or "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Range:
    """A number's rule: finite, >= `low` (> `low` when `open`), <= `high`, or one of `allow`."""

    low: float | None = None
    open: bool = False
    high: float | None = None
    allow: tuple = ()

    def problem(self, value) -> str | None:
        """What is wrong with `value` (one phrase), or None."""
        if value in self.allow:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if self.low is not None and (value <= self.low if self.open else value < self.low):
            extra = f" (or {', '.join(map(str, self.allow))})" if self.allow else ""
            return f"must be {'>' if self.open else '>='} {self.low}{extra}, got {value}"
        if self.high is not None and value > self.high:
            return f"must be <= {self.high}, got {value}"
        return None


@dataclass(frozen=True)
class FileName:
    """A name that can be a file's name: not empty, no folder separator, not hidden."""

    def problem(self, value) -> str | None:
        if not value or os.sep in value or value.startswith("."):
            return f"{value!r} is not a usable file name"
        return None


def without_none(kind):
    """`X` of `X | None`; any other type as it is."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(k for k in typing.get_args(kind) if k is not type(None))
    return kind


def default_of(field: dataclasses.Field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def setting(default=None, *, help: str | None = None, group: str | None = None, check=None,  # noqa: A002
            **argparse_extra):
    """A settings field: its default (a list or dataclass as its type: a fresh one each), its help (default: its entry
    in the class docstring's Args), its flag's help group and its rule (`Range`, `FileName`). `argparse_extra` goes
    to its flag (`metavar`, `choices`, `nargs`), except `settings_parser`'s own keys: `flag` (the flag's name), and
    for a nested dataclass `prefix`, `flags` ({field: flag name}) and `switch` (the flag that turns it on)."""
    metadata = {key: value for key, value in dict(help=help, group=group, check=check).items() if value is not None}
    metadata.update(argparse_extra)
    if default is list or (isinstance(default, type) and dataclasses.is_dataclass(default)):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def check_setting(settings_type, name: str, value) -> None:
    """`value` against the rule of `settings_type`'s field `name` (SettingError), for code that holds the value
    elsewhere (a trainer config, another command's flag)."""
    check = settings_type.__dataclass_fields__[name].metadata.get("check")
    problem = check.problem(value) if check is not None else None
    if problem:
        raise SettingError(name, problem)


def check_fields(settings) -> None:
    """Each field of a settings dataclass against its type and rule (SettingError naming the first one at fault):
    a value from a config file or from Python reaches here without the command line's checks."""
    hints = typing.get_type_hints(type(settings))
    for f in fields(settings):
        value, kind = getattr(settings, f.name), hints[f.name]
        if value is None and type(None) in typing.get_args(kind):
            continue
        kind = without_none(kind)
        if typing.get_origin(kind) is list and isinstance(value, str):  # `report_to: trackio` in a config file
            value = [value]
            setattr(settings, f.name, value)
        items = value if typing.get_origin(kind) is list else [value]
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else f.metadata.get("choices")
        for item in items:
            if choices and item not in choices:
                raise SettingError(f.name, f"{item!r} is not one of {', '.join(map(str, choices))}")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            setattr(settings, f.name, value)
        if kind in (int, float, bool) and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise SettingError(f.name, f"{value!r} is not {'an integer' if kind is int else 'a ' + kind.__name__}")
        check_setting(type(settings), f.name, value)


def check_as(settings_type, holder, names: dict[str, str], skip: tuple = ()) -> None:
    """The fields of `holder` (a Python-facing config) that are `settings_type`'s settings under other names
    (`names`: the holder's field -> the setting's), checked by `settings_type`'s rules: a `settings_type` built from
    them, and its SettingError raised as a ValueError naming the holder's field. `skip`: settings not checked."""
    ours = {setting: name for name, setting in names.items()}
    try:
        settings_type(**{setting: getattr(holder, name) for name, setting in names.items() if setting not in skip})
    except SettingError as error:
        raise ValueError(f"{ours[error.name]}: {error.message}") from None
