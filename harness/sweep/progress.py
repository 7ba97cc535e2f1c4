"""The sweep's progress bar on stderr: the phase it is in, tests done of the work known now.

A sweep learns its work as it goes: the suite runs are known once collection is done,
each alone rerun, search replay or pair run when a phase queues it. The bar's total is
the tests known now and grows as phases add work, so it never sits at 100% while a
phase still has queued work, and it says which phase it is in. Its time left is the
known work at the rate seen in this phase, shown only once a tenth of that work is done
and never in a phase whose work is found as it goes (searches: each replay decides the
next); a sweep's first estimate, made from the suite run's start-up, read 13 hours.
Off when stderr is not a terminal (a CI log gets no bar) or with --no-progress.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

from tqdm import tqdm  # type: ignore[import-untyped]

ETA_AFTER = 0.1  # the share of a phase's known work done before its time left is shown
OPEN_ENDED = frozenset({"searches"})  # phases whose work is found as they go: no time left
FORMAT = "{desc}: {n_fmt}/{total_fmt} tests |{bar}| {percentage:3.0f}% [{elapsed}{postfix}]"


class _Bar(tqdm):  # type: ignore[misc]
    """tqdm without its monitor thread: the sweep's own updates refresh the bar, and the
    monitor outlives the bar by up to ten seconds, so a sweep made in a process that then
    forks (a test of the fork server's checks) left a thread that read as a fork hazard."""

    monitor_interval = 0


class Progress:
    """The bar: `phase(name)` as a phase starts, `expect(n)` as jobs are queued, `add(n)` as
    a process starts n tests, `update(n)` as tests finish (from the executors' threads)."""

    def __init__(self, enabled: bool, stream: IO[str] | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and _is_terminal(self.stream)
        self._lock = threading.Lock()
        self._bar: Any = _Bar(total=0, desc="capsafe sweep", unit="test", file=self.stream,
                              disable=not self.enabled, leave=False, dynamic_ncols=True,
                              bar_format=FORMAT)  # fmt: skip
        self.name = ""
        self._phase_start = time.monotonic()
        self._phase_done = 0  # tests done since this phase started
        self._phase_total = 0  # tests known to this phase, done or not
        self._reserved = 0  # of the total, tests queued that no process has started yet

    @property
    def total(self) -> int:
        return int(self._bar.total or 0)

    @property
    def done(self) -> int:
        return int(self._bar.n)

    def phase(self, name: str) -> None:
        """A phase begins: its name on the bar, its own rate for the time left."""
        with self._lock:
            self.name = name
            self._phase_start = time.monotonic()
            self._phase_done = 0
            self._phase_total = max(0, self.total - self.done)  # what it inherits, still to do
            self._bar.set_description_str(f"capsafe sweep, {name}", refresh=False)
            self._refresh()

    def expect(self, tests: int) -> None:
        """Work queued but not started: at least `tests` tests (a pool's jobs, one each),
        counted in the total now; the replays that run them take it up (`add`)."""
        with self._lock:
            self._reserved += tests
            self._grow(tests)

    def add(self, tests: int) -> None:
        """A process starts `tests` tests: more work, less what `expect` counted already."""
        with self._lock:
            taken = min(tests, self._reserved)
            self._reserved -= taken
            self._grow(tests - taken)

    def release(self) -> None:
        """Queued work that never started (the budget ran out) leaves the total."""
        with self._lock:
            self._grow(-self._reserved)
            self._reserved = 0

    def _grow(self, tests: int) -> None:
        self._bar.total = max(self.done, self.total + tests)
        self._phase_total = max(self._phase_done, self._phase_total + tests)
        self._refresh()

    def update(self, tests: int) -> None:
        """`tests` more tests finished."""
        with self._lock:
            if self.done + tests > self.total:  # a test no phase announced (a resumed run)
                self._bar.total = self.done + tests
            self._phase_done += tests
            left = self.time_left()
            self._bar.set_postfix_str("" if left is None else f"~{tqdm.format_interval(left)} left",
                                      refresh=False)  # fmt: skip
            self._bar.update(tests)  # drawn at tqdm's own pace

    def time_left(self) -> float | None:
        """Seconds left of the work known to this phase, at its own rate; None until a
        tenth of it is done, and in a phase whose work is found as it goes."""
        if self.name in OPEN_ENDED or self._phase_total <= 0:
            return None
        share = self._phase_done / self._phase_total
        if share < ETA_AFTER:
            return None
        elapsed = time.monotonic() - self._phase_start
        return elapsed * (self._phase_total - self._phase_done) / max(1, self._phase_done)

    def _refresh(self) -> None:
        left = self.time_left()
        postfix = "" if left is None else f"~{tqdm.format_interval(left)} left"  # after ", "
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or no isatty
        return False
