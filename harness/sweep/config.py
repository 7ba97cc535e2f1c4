"""`[tool.capsafe]` in pyproject.toml: a project's own defaults for `capsafe sweep`.

The keys are the sweep's long option names without their dashes (`isolation-runs`;
`isolation_runs` is read the same), plus `paths` and `pytest-args` (what follows `--`);
the sweep's argparse parser is the one table of options, so a key is checked against
its actions and a value through the action's own type. The file read is the
pyproject.toml in the current directory or the nearest directory above it (as ruff
finds it); its relative paths are relative to that file. Values become the parser's
defaults, so a flag given on the command line overrides them.

ini files (setup.cfg, tox.ini, pytest.ini) are not read: they hold the project's pytest
options, which the sweep passes through untouched, and a second place for the sweep's
own would only make one of them lose silently.

`--resume`, `--force` and `--help` are flags only: they say what to do with one --out
on one invocation, never a project default.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .options import SweepError

FILE = "pyproject.toml"
TABLE = "tool.capsafe"
FLAGS_ONLY = frozenset({"resume", "force", "help"})
PASSTHROUGH = "pytest-args"  # the arguments after `--`
PATH_KEYS = frozenset({"out", "baseline", "junitxml"})  # values resolved relative to the file


@dataclass(frozen=True)
class SweepConfig:
    """The parser defaults one pyproject.toml gives; `path` None where none was found."""

    path: Path | None = None
    defaults: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """What the sweep's first console line says about it ('' for no table)."""
        if self.path is None or not self.defaults:
            return ""
        return f"config={self.path} [{TABLE}]"


def find(start: Path) -> Path | None:
    """The pyproject.toml in `start` or the nearest directory above it."""
    for directory in (start, *start.parents):
        if (directory / FILE).is_file():
            return directory / FILE
    return None


def load(parser: argparse.ArgumentParser, start: Path) -> SweepConfig:
    """The `[tool.capsafe]` table above `start` as `parser`'s defaults; SweepError naming
    the file and the key for anything the parser would not take."""
    path = find(start)
    if path is None:
        return SweepConfig()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SweepError(f"cannot read {path}: {exc}") from None
    table = data.get("tool", {}).get("capsafe", {})
    if not isinstance(table, Mapping):
        raise SweepError(f"{path}: [{TABLE}] must be a table")
    actions = _actions(parser)
    defaults: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("_", "-")
        where = f"{path} [{TABLE}] {raw_key}"
        if key in FLAGS_ONLY:
            raise SweepError(f"{where}: --{key} is a command-line flag only")
        if key == PASSTHROUGH:
            defaults["pytest_args"] = _strings(value, where)
            continue
        action = actions.get(key)
        if action is None:
            known = ", ".join(sorted([*actions, PASSTHROUGH]))
            raise SweepError(f"{where}: unknown key (known: {known})")
        defaults[action.dest] = _value(action, value, where, path.parent)
    return SweepConfig(path, defaults)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by long name without dashes, and its positional `paths`."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        if not action.option_strings:
            if action.dest != "help":
                found[action.dest] = action
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and longs[0][2:] not in FLAGS_ONLY:
            found[longs[0][2:]] = action
    return found


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SweepError(f"{where}: give a list of strings, got {value!r}")
    return list(value)


def _value(action: argparse.Action, value: object, where: str, base: Path) -> object:
    """`value` as the command line would have given it, through the action's own type."""
    if action.nargs == "*":  # the paths
        return [str(base / p) for p in _strings(value, where)]
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise SweepError(f"{where}: give true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise SweepError(f"{where}: give a string or a number, got {value!r}")
    if action.dest in PATH_KEYS:
        return base / str(value)
    convert = action.type if callable(action.type) else str
    try:
        converted = convert(str(value))
    except (TypeError, ValueError):
        raise SweepError(f"{where}: {value!r} is not a valid value") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise SweepError(f"{where}: {value!r} is not one of {choices}")
    return converted
