"""pytest-run-parallel is optional: blocked in the sweep's test processes only where installed."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from importlib.machinery import ModuleSpec
from typing import Any

import pytest

from capsafe_harness.sweep import optional_plugins
from capsafe_harness.sweep.optional_plugins import quiet_plugin_args


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    def pretend(present: bool) -> None:
        optional_plugins._installed.cache_clear()
        real = importlib.util.find_spec

        def find_spec(name: str, *args: Any, **kwargs: Any) -> ModuleSpec | None:
            if name == optional_plugins.RUN_PARALLEL_MODULE:
                return real("json") if present else None
            return real(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    yield pretend
    optional_plugins._installed.cache_clear()


def test_blocked_only_when_installed_and_not_used(installed: Callable[[bool], None]) -> None:
    installed(True)
    assert quiet_plugin_args(1) == ["-p", "no:run-parallel"]
    assert quiet_plugin_args(4) == []  # --threads 4 needs it
    installed(False)
    assert quiet_plugin_args(1) == []
