"""A command line generated from a settings dataclass (`loop_settings`): TRL's `TrlParser` with this kit's flags.

Each field becomes one dashed flag in its help group, made as `grpo_lab.lab.settings_parser` makes them;
`--config file.yaml` sets any field by name (flags given override it). Every mistake is one line and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse

import yaml
from trl.scripts.utils import TrlParser

from ..lab.settings import SettingError
from ..lab.settings_parser import ConfigParser, DefaultsFormatter, add_setting_flag
from .checks import UsageError, first_line


class SettingsParser(TrlParser):
    """`TrlParser` over one settings dataclass (`LoopSettings`, `PoolSettings`) with dashed flags and one-line
    errors."""

    def __init__(self, settings_type, prog: str, description: str):
        self._groups: dict[str, argparse._ArgumentGroup] = {}
        super().__init__(settings_type, prog=prog, description=description, formatter_class=DefaultsFormatter)
        self.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=(
            "read settings from a YAML file (the flags' names with '_' as keys; flags given here override it)"))

    error = ConfigParser.error  # one line and exit status 2, as every generated command line

    def _parse_dataclass_field(self, parser, field):
        """One field's flag. Called by `HfArgumentParser.__init__` for each field, in their order."""
        group = field.metadata.get("group")
        if group is not None:
            if group not in self._groups:
                self._groups[group] = self.add_argument_group(group)
            parser = self._groups[group]
        add_setting_flag(parser, field, field.type)  # HfArgumentParser has resolved its type

    def parse_args_into_dataclasses(self, args=None, return_remaining_strings=False, **_ignored):
        """HfArgumentParser's, without its search for a `<script>.args` file next to the program."""
        return super().parse_args_into_dataclasses(args, return_remaining_strings, look_for_args_file=False)

    def parse(self, argv: list[str]):
        """The settings `argv` (and its `--config` file) give. A refused flag exits (status 2, its one line printed),
        as `--help` does (0); a refused value or config file raises UsageError naming the flag."""
        argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
        if "--config" in argv:
            after = argv[argv.index("--config") + 1:]
            if not after or after[0].startswith("-"):
                self.error("argument --config: expected one argument")
        try:
            settings, from_file, given = self.parse_args_and_config(
                argv, return_remaining_strings=True, separate_remaining_strings=True)
        except SettingError as error:
            raise UsageError(error.flag, error.message) from None
        except (OSError, yaml.YAMLError, ValueError) as error:
            first = first_line(error, type(error).__name__)
            what = f"{after[0]} is not a YAML file of settings ({first})" if isinstance(error, yaml.YAMLError) \
                else first
            raise UsageError("--config", what) from None
        if from_file:
            raise UsageError("--config", f"unknown settings {', '.join(from_file[::2])} (a key is a flag's name with "
                                         f"'_', e.g. max_steps)")
        if given:
            self.error(f"unrecognized arguments: {' '.join(given)}")
        return settings
