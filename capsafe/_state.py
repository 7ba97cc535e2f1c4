"""Process-wide state, reset in one place: in a forked child, and between tests.

Modules that keep process-wide state (the driver and its facades, the capture
gate, the device registry, locks) register their reset here instead of with
`os.register_at_fork` each. One fork hook runs them all in the child, in the
order they registered; `reset_for_tests()` runs the same state resets (not the
lock renewals a child needs: in a live process another thread may hold a lock),
so tests never patch a module's private globals.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capsafe.backend import Backend

#: (reset, also between tests); a reset takes `forked`: True in a forked child.
_resets: list[tuple[Callable[[bool], None], bool]] = []


def on_reset(reset: Callable[[bool], None]) -> Callable[[bool], None]:
    """Register `reset(forked)`: run in a forked child (forked=True) and by `reset_for_tests`."""
    _resets.append((reset, True))
    return reset


def on_fork(renew: Callable[[], None]) -> Callable[[], None]:
    """Register `renew()`, run in a forked child only (fresh locks a parent thread may hold)."""
    _resets.append((lambda _forked: renew(), False))
    return renew


def reset_for_tests(backend: Backend | None = None) -> None:
    """Forget the process-wide driver, facades, gate and devices, as if capsafe were just imported.

    With `backend`, it becomes the process-wide backend that `driver.get()` wraps
    (already initialized by the caller). Call it again at teardown to forget it.
    """
    for reset, in_tests in _resets:
        if in_tests:
            reset(False)
    if backend is not None:
        from capsafe import driver

        driver._adopt(backend, "set by capsafe._state.reset_for_tests")


def _after_fork_in_child() -> None:
    for reset, _ in _resets:
        reset(True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
