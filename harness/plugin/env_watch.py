"""What a test left changed in the environment: the watched variables, before and after.

The plugin snapshots the environment around each test (twice per test, so the copy must
be cheap) and records the watched variables that differ as the row's `env_leak`.
"""

from __future__ import annotations

import os
from typing import Any

PYTEST_OWN = "PYTEST_CURRENT_TEST"  # pytest sets it for each phase: never a leak


def snapshot() -> dict[Any, Any]:
    """A cheap copy of the whole environment, taken twice per test.

    `os.environ._data` is the raw mapping behind os.environ; copying it is a C-level
    dict copy, where walking os.environ decodes every variable (about a hundred
    times slower, and it dominated the plugin's per-test cost).
    """
    raw = getattr(os.environ, "_data", None)
    return raw.copy() if isinstance(raw, dict) else dict(os.environ)


def leaks(
    before: dict[Any, Any], after: dict[Any, Any], prefixes: tuple[str, ...]
) -> dict[str, list[str | None]]:
    """{VAR: [before, after]} for watched variables that differ (None: unset)."""

    def text(value: Any) -> str:
        return os.fsdecode(value) if isinstance(value, bytes) else value

    leaks = {}
    for key in before.keys() | after.keys():
        name = text(key)
        if name == PYTEST_OWN:
            continue
        if name.startswith(prefixes) and before.get(key) != after.get(key):
            old, new = before.get(key), after.get(key)
            leaks[name] = [None if old is None else text(old), None if new is None else text(new)]
    return dict(sorted(leaks.items()))
