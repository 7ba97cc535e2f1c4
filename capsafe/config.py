"""Settings read from the environment once, frozen, and guarded against later changes.

A process-wide setting read on first use is a trap in a test run: a later phase
that sets the variable changes nothing, and its results are silently attributed
to the wrong setting. `FrozenConfig` makes that visible. It reads the variables
it declares once, keeps the raw values next to the parsed result, and, while
the guard is on, re-reads them on every later `get()` and raises
`FrozenConfigError` naming each variable that moved. With the guard off a read
costs one attribute load on top of returning the cached value.

`runtime_config()` is capsafe's own instance; users declare theirs the same way:

    MYAPP = FrozenConfig("myapp", ["MYAPP_KERNEL"], lambda env: env["MYAPP_KERNEL"] or "fast")
    kernel = MYAPP.get()

There is deliberately no reset: a configuration phase that needs other values
runs in its own child process (subprocess, or multiprocessing with "spawn").
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from capsafe._diagnostics import outside_frame
from capsafe.errors import CapsafeError, UsageError

T = TypeVar("T")
Environ = Mapping[str, "str | None"]

REMEDY = (
    "run each configuration phase in its own child process (subprocess, or multiprocessing "
    "with the 'spawn' start method) with its environment set before the child starts"
)


@dataclass(frozen=True, slots=True)
class Change:
    """One watched variable whose value moved; `None` means unset."""

    variable: str
    frozen: str | None
    current: str | None

    def describe(self) -> str:
        return f"{self.variable}: frozen {_show(self.frozen)}, now {_show(self.current)}"


def _show(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def find_changed(frozen: Environ, current: Environ) -> list[Change]:
    """Every variable whose value differs, sorted by name; a missing key counts as unset."""
    names = sorted(set(frozen) | set(current))
    return [
        Change(name, frozen.get(name), current.get(name))
        for name in names
        if frozen.get(name) != current.get(name)
    ]


class FrozenConfigError(CapsafeError, RuntimeError):
    """A variable feeding a frozen configuration changed after the freeze."""

    def __init__(self, config: str, changes: list[Change], frozen_at: str) -> None:
        self.config = config
        self.changes = list(changes)
        self.frozen_at = frozen_at
        lines = [f"configuration {config!r} changed after it froze at {frozen_at}:"]
        lines += [f"  {change.describe()}" for change in self.changes]
        lines.append(f"the process keeps the frozen values; {REMEDY}")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type[FrozenConfigError], tuple[str, list[Change], str]]:
        # exact across xdist and multiprocessing
        return (type(self), (self.config, self.changes, self.frozen_at))


# -- the guard switch ---------------------------------------------------------


FROZEN_GUARD_VARIABLE = "CAPSAFE_FROZEN_GUARD"
"""Read by the guard switch alone (it decides how the others are read, so it is not one of them)."""


class _GuardSwitch:
    """Process-wide on/off. Settled from CAPSAFE_FROZEN_GUARD at the first freeze,
    unless `enable_guard()` or `disable_guard()` settled it first."""

    __slots__ = ("on", "settled")

    def __init__(self) -> None:
        self.on = False
        self.settled = False

    def settle(self, environ: Mapping[str, str]) -> None:
        if not self.settled:
            self.on = parse_bool(environ, FROZEN_GUARD_VARIABLE, default=False)
            self.settled = True


_guard = _GuardSwitch()


def enable_guard() -> None:
    """Turn the guard on for every frozen configuration in this process (the harness does)."""
    _guard.on = True
    _guard.settled = True


def disable_guard() -> None:
    """Turn the guard off for this process, whatever CAPSAFE_FROZEN_GUARD says."""
    _guard.on = False
    _guard.settled = True


def guard_enabled() -> bool:
    """Whether later reads re-check their variables (settles the switch if nothing has yet)."""
    _guard.settle(os.environ)
    return _guard.on


# -- frozen configurations ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Frozen(Generic[T]):
    value: T
    environ: dict[str, str | None]
    frozen_at: str


class FrozenConfig(Generic[T]):
    """A configuration parsed from `variables` on the first `get()` and frozen there.

    `parse` receives a mapping holding exactly the declared variables (None when
    unset) and returns the configuration. `environ` defaults to `os.environ`;
    `guard` forces the guard on or off for this instance (None: the process switch).
    """

    def __init__(
        self,
        name: str,
        variables: Iterable[str],
        parse: Callable[[Environ], T],
        *,
        environ: Mapping[str, str] | None = None,
        guard: bool | None = None,
    ) -> None:
        self.name = name
        self.variables = tuple(dict.fromkeys(variables))
        if not self.variables:
            raise UsageError(f"configuration {name!r} declares no variables")
        self._parse = parse
        self._environ = os.environ if environ is None else environ
        self._guard = _guard if guard is None else _FixedGuard(guard)
        self._lock = threading.Lock()
        self._frozen: _Frozen[T] | None = None

    def get(self) -> T:
        """The frozen value; under the guard, first check that no variable moved."""
        frozen = self._frozen
        if frozen is None:
            return self._freeze()
        if self._guard.on:
            self._check(frozen)
        return frozen.value

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    @property
    def frozen_at(self) -> str | None:
        """file:line of the first read outside capsafe, once frozen."""
        return None if self._frozen is None else self._frozen.frozen_at

    def changes(self) -> list[Change]:
        """What moved since the freeze (empty before it), whether or not the guard is on."""
        frozen = self._frozen
        return [] if frozen is None else find_changed(frozen.environ, self._read())

    def _read(self) -> dict[str, str | None]:
        return {name: self._environ.get(name) for name in self.variables}

    def _freeze(self) -> T:
        with self._lock:
            if self._frozen is None:
                _guard.settle(os.environ)
                environ = self._read()
                self._frozen = _Frozen(self._parse(environ), environ, _caller_site())
                return self._frozen.value
        return self.get()

    def _check(self, frozen: _Frozen[T]) -> None:
        changes = find_changed(frozen.environ, self._read())
        if changes:
            raise FrozenConfigError(self.name, changes, frozen.frozen_at)

    def __repr__(self) -> str:
        state = f"frozen at {self.frozen_at}" if self.frozen else "not read yet"
        return f"FrozenConfig({self.name!r}, {list(self.variables)}, {state})"


@dataclass(frozen=True, slots=True)
class _FixedGuard:
    on: bool


def _caller_site() -> str:
    """file:line of the innermost frame outside the capsafe package."""
    frame = outside_frame(sys._getframe(1))
    if frame is None:
        return "<capsafe>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


# -- parsing helpers (public: users' parse functions want the same messages) ----

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(UsageError):
    """An environment variable holds a value its setting cannot take.

    A setting is not any one command's mistake, so every entry point reports it the
    same way: `capsafe: NAME='value' is not valid; use one of: ...`, exit 2.
    """


def _value(environ: Environ, name: str) -> str | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def parse_bool(environ: Environ, name: str, default: bool) -> bool:
    """1/0, true/false, yes/no, on/off (any case); unset or empty gives `default`."""
    raw = _value(environ, name)
    if raw is None:
        return default
    word = raw.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    accepted = ", ".join(TRUE_WORDS + FALSE_WORDS)
    raise SettingError(f"{name}={raw!r} is not a boolean; use one of: {accepted}")


def parse_choice(environ: Environ, name: str, choices: tuple[str, ...], default: str) -> str:
    """One of `choices` (case-insensitive); unset or empty gives `default`."""
    raw = _value(environ, name)
    if raw is None:
        return default
    if raw.lower() not in choices:
        raise SettingError(f"{name}={raw!r} is not valid; use one of: {', '.join(choices)}")
    return raw.lower()


def _parse_int(
    environ: Environ,
    name: str,
    default: int,
    minimum: int,
    remedy: str,
    maximum: int | None = None,
) -> int:
    """An integer in [`minimum`, `maximum`]; unset or empty gives `default`; else
    `NAME='raw' remedy`."""
    raw = _value(environ, name)
    if raw is None:
        return default
    try:
        number = int(raw)
    except ValueError:
        number = minimum - 1
    if number < minimum or (maximum is not None and number > maximum):
        raise SettingError(f"{name}={raw!r} {remedy}")
    return number


def parse_size(environ: Environ, name: str, default: int) -> int:
    """A byte count >= 0; unset or empty gives `default`."""
    remedy = "is not a byte count; use an integer >= 0 (0 = unbounded)"
    return _parse_int(environ, name, default, 0, remedy)


def parse_count(environ: Environ, name: str, default: int, unit: str, maximum: int) -> int:
    """A whole number of `unit` (plural), 1 to `maximum`; unset or empty gives `default`."""
    remedy = f"is not valid; use a whole number of {unit}, 1 to {maximum}"
    return _parse_int(environ, name, default, 1, remedy, maximum)


# -- capsafe's own settings ---------------------------------------------------

BACKENDS = ("cuda", "sim", "auto")
GATE_POLICIES = ("conservative", "measured")
DEFAULT_KERNEL_CACHE_MAX_BYTES = 256 * 1024 * 1024
#: The most devices the simulated machine may have: more than any real node (an
#: NVLink domain of 72 GPUs is not one process's machine), and each costs memory and
#: start-up time before the first call (10^6 took 7-10 s and 320 MB).
MAX_SIM_DEVICES = 64


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """capsafe's settings. Library code also takes these as explicit parameters."""

    backend: str = "auto"
    gate_policy: str = "conservative"
    gate_enabled: bool = True
    kernel_cache_enabled: bool = True
    kernel_cache_dir: Path | None = None
    kernel_cache_max_bytes: int = DEFAULT_KERNEL_CACHE_MAX_BYTES
    sim_devices: int = 1  # how many devices the simulated machine has

    VARIABLES = (
        "CAPSAFE_BACKEND",
        "CAPSAFE_GATE_POLICY",
        "CAPSAFE_GATE",
        "CAPSAFE_KERNEL_CACHE",
        "CAPSAFE_KERNEL_CACHE_DIR",
        "CAPSAFE_KERNEL_CACHE_MAX_BYTES",
        "CAPSAFE_SIM_DEVICES",
    )

    @classmethod
    def from_environ(cls, environ: Environ) -> RuntimeConfig:
        """Parse an explicit mapping; freezes nothing (for tests and child-process setup)."""
        cache_dir = _value(environ, "CAPSAFE_KERNEL_CACHE_DIR")
        return cls(
            backend=parse_choice(environ, "CAPSAFE_BACKEND", BACKENDS, "auto"),
            gate_policy=parse_choice(environ, "CAPSAFE_GATE_POLICY", GATE_POLICIES, "conservative"),
            gate_enabled=parse_bool(environ, "CAPSAFE_GATE", True),
            kernel_cache_enabled=parse_bool(environ, "CAPSAFE_KERNEL_CACHE", True),
            kernel_cache_dir=None if cache_dir is None else Path(cache_dir),
            kernel_cache_max_bytes=parse_size(
                environ, "CAPSAFE_KERNEL_CACHE_MAX_BYTES", DEFAULT_KERNEL_CACHE_MAX_BYTES
            ),
            sim_devices=parse_count(environ, "CAPSAFE_SIM_DEVICES", 1, "devices", MAX_SIM_DEVICES),
        )


def check_settings(environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    """Parse every capsafe setting now, freezing nothing; `SettingError` names the first bad one.

    Commands call this first, so a bad value is one line and exit 2 before any work starts,
    whichever command the user ran.
    """
    env = os.environ if environ is None else environ
    parse_bool(env, FROZEN_GUARD_VARIABLE, default=False)
    return RuntimeConfig.from_environ(env)


RUNTIME = FrozenConfig("capsafe", RuntimeConfig.VARIABLES, RuntimeConfig.from_environ)


def runtime_config() -> RuntimeConfig:
    """capsafe's settings, read from the environment on first use and frozen."""
    return RUNTIME.get()
