"""Capture windows a framework opens itself, held on the gate's exclusive side.

A framework's begin call (`Stream.begin_capture`, `GraphBuilder.begin_building`)
takes the exclusive side first; the guard is stored under the framework's key
for that capture (a stream pointer, a builder) and released by the matching end
call, also when the end call raises. Teardown the capturing thread asks for in
between is deferred by the gate to the release, as for `capsafe.capture`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

from capsafe.backend import Backend
from capsafe.driver import GatedDriver, breaking_calls
from capsafe.gate import CaptureGate, CaptureGuard
from capsafe.handles import CaptureMode, StreamKind

log = logging.getLogger("capsafe")
T = TypeVar("T")


def gate_of(driver: Backend) -> CaptureGate | None:
    """The gate behind a facade from `capsafe.driver.get()`; None when it gates nothing."""
    return driver.gate if isinstance(driver, GatedDriver) else None


def exclusive(
    driver: Backend, mode: CaptureMode, kind: Callable[[], StreamKind], label: str
) -> CaptureGuard | None:
    """Take the exclusive side for one window as `driver.stream_begin_capture` would.

    `kind` is only called under the measured policy (it may cost a driver query).
    """
    if not isinstance(driver, GatedDriver) or driver.gate is None:
        return None
    harmful = None if driver.policy == "conservative" else breaking_calls(mode, kind())
    return driver.gate.begin_capture(harmful=harmful, label=label, timeout=driver.capture_timeout)


def _safely(still_active: Callable[[], bool]) -> bool:
    try:
        return still_active()
    except Exception:  # an invalidated or broken capture: nothing left to protect
        return False


class Windows:
    """Open windows by key. Thread-safe: a capture may end on another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Hashable, CaptureGuard] = {}
        self.opened = 0  # windows begun so far: tells one window from the next

    def __len__(self) -> int:
        return len(self._open)

    def begin(
        self, key: Hashable, guard: Callable[[], CaptureGuard | None], begin: Callable[[], T]
    ) -> T:
        """Take the guard, run the framework's begin call; the guard goes back if it raises."""
        taken = guard()
        try:
            result = begin()
        except BaseException:
            if taken is not None:
                taken.release()
            raise
        if taken is not None:
            with self._lock:
                stale = self._open.pop(key, None)
                self._open[key] = taken
                self.opened += 1
            if stale is not None:  # the framework reused a key whose end we never saw
                stale.release()
        return result

    def end(
        self, key: Hashable, end: Callable[[], T], still_active: Callable[[], bool] | None = None
    ) -> T:
        """Run the framework's end call, then release the key's guard.

        Also when the end call raises, unless `still_active()` says the capture is
        still open and intact (the driver refused to end it, e.g. from the wrong
        thread): then the guard stays, for the end call that really ends it.
        """
        with self._lock:
            taken = self._open.pop(key, None)
        ended = True
        try:
            return end()
        except BaseException:
            if taken is not None and still_active is not None and _safely(still_active):
                ended = False
                with self._lock:
                    self._open[key] = taken
            raise
        finally:
            if ended and taken is not None:
                taken.release()

    def release_all(self) -> list[str]:
        """Release every guard still held (their captures were never ended); their labels."""
        with self._lock:
            left, self._open = list(self._open.values()), {}
        for guard in left:
            log.warning("capsafe: releasing the gate held by an unended capture %s", guard.label)
            guard.release()
        return [guard.label for guard in left]
