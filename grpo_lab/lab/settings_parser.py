"""A command line generated from a settings dataclass, with argparse alone (the router and the replicas start without
importing transformers; `async_loop.settings_parser` adds TRL's `--config file.yaml`). Each field is one dashed flag
(or its `flag`): a bool a switch (`--no-...` when it defaults to True), a list a repeatable flag, a `Literal` a
choice, its rule checked as the flag is read; a nested dataclass gives its fields' flags (`prefix`, `flags`, and a
`switch` for an optional one). Defaults are read from the class; every mistake is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from typing import Literal

from .settings import default_of, without_none

OWN_KEYS = ("check", "group", "flag", "prefix", "flags", "switch")  # metadata read here, not given to argparse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each flag's default, except where there is none to show (None, a switch, a repeatable flag)."""

    def _get_help_string(self, action):
        if action.default in (None, []) or action.nargs == 0 or isinstance(action, argparse._AppendAction):
            return action.help
        return super()._get_help_string(action)


def checked_type(kind, check):
    """An argparse type: `kind(text)`, refused in one phrase when it is not a `kind` or breaks `check`'s rule."""
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, TypeError):
            noun = {int: "an integer", float: "a number"}.get(kind, "a valid value")
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        problem = check.problem(value) if check is not None else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def documented_args(cls) -> dict[str, str]:
    """Each field's entry in the `Args:` section of `cls`'s docstring (`host, port: ...` documents both)."""
    docs, names = {}, []
    section = (inspect.getdoc(cls) or "").partition("Args:\n")[2]
    for line in section.replace("%", "%%").splitlines():  # argparse formats help with %
        entry = re.match(r"    (\w+(?:, \w+)*): (.*)", line)
        if line.startswith("        "):
            docs.update({name: f"{docs[name]} {line.strip()}" for name in names})
        elif entry:
            names = entry.group(1).split(", ")
            docs.update({name: entry.group(2) for name in names})
        elif line.strip():
            break
    return docs


def add_setting_flag(parser, field: dataclasses.Field, kind, *, flag: str | None = None, dest: str | None = None,
                     default=dataclasses.MISSING, help: str | None = None):  # noqa: A002
    """The flag of one settings field (`kind` its resolved type) on `parser` (or an argument group)."""
    options = {key: value for key, value in field.metadata.items() if key not in OWN_KEYS}
    options.setdefault("help", help)
    check, kind = field.metadata.get("check"), without_none(kind)
    name = "--" + (flag or field.metadata.get("flag") or field.name.replace("_", "-"))
    dest = dest or field.name
    default = default_of(field) if default is dataclasses.MISSING else default
    if kind is bool:
        if default and "help" not in field.metadata:
            options["help"] = f"switch off: {options['help']}"  # the docstring says what the field turns on
        switch = ("--no-" + name[2:], "store_false") if default else (name, "store_true")
        return parser.add_argument(switch[0], dest=dest, action=switch[1], default=bool(default), **options)
    if typing.get_origin(kind) is Literal:
        options["choices"] = typing.get_args(kind)
        kind = type(options["choices"][0])
    else:
        options.setdefault("metavar", name[2:].upper().replace("-", "_"))
    if typing.get_origin(kind) is list:
        action = "store" if "nargs" in options else "append"
        parser.add_argument(name, dest=dest, action=action, type=typing.get_args(kind)[0], default=default, **options)
    else:
        parser.add_argument(name, dest=dest, type=checked_type(kind, check), default=default, **options)


class ConfigParser(argparse.ArgumentParser):
    """The command line of one config dataclass (`RouterConfig`), nested dataclasses flattened; `parse` gives the
    instance, and the flags added with `add_argument` that are not settings in a namespace beside it."""

    def __init__(self, config_type, prog: str, description: str):
        super().__init__(prog=prog, description=description, formatter_class=DefaultsFormatter)
        self.config_type = config_type
        self._add_fields(config_type, path=(), defaults=None, prefix="", flags={})

    def _add_fields(self, cls, path: tuple, defaults, prefix: str, flags: dict):
        hints, docs = typing.get_type_hints(cls), documented_args(cls)
        for field in dataclasses.fields(cls):
            kind, dest = hints[field.name], ".".join((*path, field.name))
            default = getattr(defaults, field.name) if defaults is not None else default_of(field)
            nested = without_none(kind)
            if dataclasses.is_dataclass(nested):
                if "switch" in field.metadata:  # None unless its switch is given
                    self.add_argument("--" + field.metadata["switch"], dest=dest + ".on", action="store_true",
                                      help=field.metadata.get("help", docs.get(field.name)))
                self._add_fields(nested, (*path, field.name), default, field.metadata.get("prefix", ""),
                                 field.metadata.get("flags", {}))
                continue
            flag = flags.get(field.name) or field.metadata.get("flag") or prefix + field.name.replace("_", "-")
            add_setting_flag(self, field, kind, flag=flag, dest=dest, default=default,
                             help=field.metadata.get("help", docs.get(field.name)))

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _build(self, cls, path: tuple, values: dict):
        kwargs = {}
        for field in dataclasses.fields(cls):
            dest = ".".join((*path, field.name))
            if dest in values:
                kwargs[field.name] = values.pop(dest)
                continue
            nested = self._build(without_none(typing.get_type_hints(cls)[field.name]), (*path, field.name), values)
            kwargs[field.name] = nested if values.pop(dest + ".on", True) else None
        return cls(**kwargs)

    def parse(self, argv=None):
        """`(config, rest)`: the config the flags give, and a namespace of the flags that are not settings. A
        refused flag or a config its class refuses (ValueError) exits with status 2 and one line."""
        values = vars(self.parse_args(argv))
        try:
            config = self._build(self.config_type, (), values)
        except ValueError as error:
            self.error(str(error))
        return config, argparse.Namespace(**values)
