"""Neighbour threads: background work that breaks any capture not protected by the gate.

A capture hazard only shows when another thread happens to allocate or
synchronize during the capture window, which in a quiet test run is rare. The
neighbours make it the common case: each thread keeps making the hazard
actions (`capsafe.hazards.actions`) whose hazard-table row can break a capture,
through the process-wide driver facade. An ungated capture in a test then
fails fast, while a capture taken through `capsafe.capture` makes the
neighbours wait at the gate and survives.

They bind the device's primary context through `capsafe.context`, the context
CuPy, PyTorch and cuda.core also use, so their calls meet the test's captures.
They are daemon threads and are joined with a deadline: one stuck in a driver
call is reported, never waited on, and the process still exits. Each process
writes what its neighbours did (calls and driver errors per call kind, threads
that failed or stuck, or why they could not start) to a status file beside its
records, which the sweep reads.

capsafe is imported only when neighbours start, so a run without
`--capsafe-neighbors` never loads it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("capsafe.harness")

DEFAULT_INTERVAL_S = 0.001
STOP_TIMEOUT_S = 5.0
STATUS_GLOB = "neighbors-*.json"

#: Capture-breaking actions a neighbour does not make, and why.
NOT_ISSUED = {
    "stream_query_capturing": "needs the test's own capturing stream",
    "module_unload": "needs a module image, and JIT-loading one per cycle would dominate",
}


def _breaking_names() -> tuple[str, ...]:
    from capsafe.hazards.actions import BREAKING

    return tuple(a.name for a in BREAKING if a.name not in NOT_ISSUED)


def issued_calls() -> tuple[str, ...]:
    """The hazard-action names neighbours make, in the table's order: the call kinds."""
    return _breaking_names()


def parse_calls(text: str) -> tuple[str, ...]:
    """`ctx_sync,mem_alloc` -> the call kinds, validated; ValueError naming the known ones."""
    known = issued_calls()
    wanted = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        what = f"unknown call kind(s) {', '.join(unknown)}" if unknown else "no call kind given"
        raise ValueError(f"{what}; neighbours make: {', '.join(known)}")
    return wanted


class NeighborsUnavailable(Exception):
    """The neighbours cannot run in this process (no driver, no device, wrong backend)."""


@dataclass
class NeighborStatus:
    """What one process's neighbours did; written beside its records for the sweep."""

    threads: int
    calls: tuple[str, ...]
    backend: str = ""
    unavailable: str = ""  # why they could not start ("" when they did)
    steps: Counter[str] = field(default_factory=Counter)
    driver_errors: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # threads that failed or did not stop

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "calls": list(self.calls),
            "backend": self.backend,
            "unavailable": self.unavailable,
            "steps": dict(sorted(self.steps.items())),
            "driver_errors": dict(sorted(self.driver_errors.items())),
            "problems": self.problems,
        }


class Neighbors:
    """`count` daemon threads cycling through the `calls` kinds until `stop()`.

    Driver errors in a call are expected (a test's ungated capture makes the
    neighbours' own calls fail too) and only counted per kind; any other
    exception ends that thread and is reported by `stop()`.
    """

    def __init__(
        self,
        count: int,
        calls: Sequence[str] | None = None,
        interval: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self.interval = interval
        self.status = NeighborStatus(count, tuple(calls) if calls else issued_calls())
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Bind the device and start the threads; NeighborsUnavailable says why they cannot."""
        try:
            from capsafe import context, driver

            context.device(0)
            self.status.backend = driver.get().name
        except Exception as exc:  # whatever the driver raises, the test process carries on
            self.status.unavailable = f"{type(exc).__name__}: {exc}"
            raise NeighborsUnavailable(self.status.unavailable) from None
        for n in range(self.status.threads):
            thread = threading.Thread(target=self._run, name=f"capsafe-neighbor-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self) -> None:
        from capsafe import context, driver
        from capsafe.errors import CapsafeError
        from capsafe.hazards.actions import BY_NAME, ActionKit

        try:
            context.device(0)
            kit = ActionKit(driver.get())
        except Exception as exc:
            self._problem(f"could not set up: {exc!r}")
            return
        actions = [BY_NAME[name] for name in self.status.calls]
        try:
            while not self._stop.is_set():
                for action in actions:
                    if self._stop.wait(self.interval):
                        return
                    try:
                        kit.run(action)
                        self._count(self.status.steps, action.name)
                    except CapsafeError:
                        self._count(self.status.driver_errors, action.name)
        except Exception as exc:
            self._problem(f"stopped: {exc!r}")
        finally:
            try:
                kit.close()
            except Exception as exc:  # moot at shutdown; a capture may still hold a buffer
                log.debug("neighbour cleanup: %r", exc)

    def _count(self, counter: Counter[str], name: str) -> None:
        with self._lock:
            counter[name] += 1

    def _problem(self, text: str, thread: threading.Thread | None = None) -> None:
        name = (thread or threading.current_thread()).name
        with self._lock:
            self.status.problems.append(f"{name} {text}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> NeighborStatus:
        """Stop and join the threads within `timeout` in all; stuck ones are listed, left."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._problem(f"did not stop within {timeout:g} s", thread)
        self._threads.clear()
        return self.status


def status_path(directory: str | os.PathLike[str], run_id: str, worker: str) -> Path:
    return Path(directory) / f"neighbors-{run_id}-{worker}-{os.getpid()}.json"


def write_status(path: Path, status: NeighborStatus) -> None:
    """Write the status file; an unwritable one is logged, never a test failure."""
    try:
        path.write_text(json.dumps(status.to_dict()) + "\n", encoding="utf-8")
    except OSError as exc:
        log.warning("capsafe: cannot write %s: %s", path, exc)


def read_statuses(directories: Iterable[Path]) -> list[dict[str, Any]]:
    """Every readable status file under `directories` (unreadable ones are skipped)."""
    found = []
    for directory in directories:
        for path in sorted(Path(directory).glob(STATUS_GLOB)):
            try:
                found.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
    return found
