"""Where a test's captures are: each one's stream, mode and call site, and whether it ended.

Registered with the records (`--capsafe-records`): before each test it hooks the
capture points of every framework loaded by then (`capsafe.integrations.observe`,
the same methods the integrations gate; it never imports a framework, and its
wrappers return and raise exactly what the framework does). It records, per test:

- `captures` on the teardown row: every capture the test began (any phase), as
  {framework, stream, mode, site, open}: `site` is the test code's `file:line` that began
  it, `open` whether it was still open when the test ended;
- the `failed-in-capture` signal on a failing phase's row when the failure was raised
  inside one of the test's own windows: an exception escaped the end call, an exception
  was in flight when the end ran (a `with torch.cuda.graph(...)` exit), or a window the
  test began was still open when the failure reached pytest.

Evidence only: what a failure inside a window means is the verdicts' business.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from ..records import Capture

HARNESS_DIR = os.path.join(Path(__file__).resolve().parent.parent, "")  # never a call site


def preload() -> None:
    """Import the capture observer now, as a fork server does before its first fork: each
    process imports it at its first test otherwise, and a forked child would pay that
    import (6 ms of a 20 ms single-test job) every time."""
    with contextlib.suppress(ImportError):
        import capsafe.integrations.observe  # noqa: F401


class CaptureLog:
    """The current test's captures, told by an `Observer` (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Hashable, Capture] = {}  # every capture still open, any test's
        self.captures: list[Capture] = []  # the current test's
        self.failed_inside = False  # an exception escaped, or crossed, one of its windows' ends
        self.observer: Any = None
        self.problems: list[str] = []

    def start(self) -> None:
        """Hook what is loaded now; the next test's captures start here."""
        with self._lock:
            self.captures = []
            self.failed_inside = False
        if self.observer is None:
            try:
                from capsafe.integrations.observe import Observer
            except ImportError as exc:  # capsafe without the observer: nothing is recorded
                self.problems.append(f"capture observer: {exc}")
                self.observer = False
                return
            self.observer = Observer(self._began, self._ended, skip=(HARNESS_DIR,))
        if self.observer:
            self.observer.hook_loaded()

    def stop(self) -> None:
        if self.observer:
            self.observer.restore()

    def _began(self, framework: str, opened: Any, site: str) -> None:
        entry: Capture = {"framework": framework, "stream": opened.stream, "mode": opened.mode,
                          "site": site, "open": True}  # fmt: skip
        with self._lock:
            if any(c is self._open.get(opened.key) for c in self.captures):
                return  # one capture told twice (the backend, then the facade in front of it)
            self._open[opened.key] = entry
            self.captures.append(entry)

    def _ended(
        self,
        framework: str,
        key: Hashable,
        raised: BaseException | None,
        in_flight: BaseException | None,
    ) -> None:
        with self._lock:
            entry = self._open.pop(key, None)
            if entry is None:
                return
            entry["open"] = False
            if any(c is entry for c in self.captures) and (raised or in_flight):
                self.failed_inside = True

    def failure_inside(self) -> bool:
        """Was the failure now reaching pytest raised inside one of the test's windows?"""
        with self._lock:
            return self.failed_inside or any(c["open"] for c in self.captures)

    def recorded(self) -> list[Capture]:
        """The current test's captures, as they stand now (copies)."""
        with self._lock:
            return [Capture(**c) for c in self.captures]
