"""Where a sweep's time goes: its own phases, and inside each test process.

A sweep of a GPU suite is dominated by process start-up, not by the tests: each
pytest process starts the interpreter and pytest, imports the suite (and its
framework), initializes CUDA, and only then runs tests. The plugin writes one
marks file per process (`process-*.json` beside its records: unix times of
process start, pytest configured, collection done, neighbours (and with them
CUDA) ready, session end); the sweep adds each test's own phase times from the
records and sums both over all processes into `summary.json`'s `phase_times`.

Stdlib only: the plugin imports this module in every test process it records.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MARKS_GLOB = "process-*.json"
#: The marks, in the order a process reaches them.
MARKS = ("started", "configured", "collected", "cuda_ready", "finished")
#: Process phase -> (from mark, to mark); a missing mark skips the phase for that process.
PROCESS_PHASES = {
    "pytest_start": ("started", "configured"),
    "collection": ("configured", "collected"),
    "neighbors_cuda_init": ("collected", "cuda_ready"),
}


def process_start_time() -> float | None:
    """Unix time this process started (Linux /proc), None where that cannot be read.

    Its start in clock ticks since boot, against the seconds since boot now
    (/proc/uptime, hundredths): the boot time /proc/stat gives is whole seconds, which
    put every process's start up to a second early (and each forked child's start-up
    at 0.5-0.8 s where it took milliseconds)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        now, uptime = time.time(), float(Path("/proc/uptime").read_text().split()[0])
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


PLUGIN_NAME = "capsafe-marks"


def register(config: Any, records: str | None, run_id: str, worker: str) -> None:
    """Record this process's marks beside its records (only when records are written)."""
    if records:
        config.pluginmanager.register(ProcessMarks(records, run_id, worker), PLUGIN_NAME)


class ProcessMarks:
    """The marks of this test process, written beside its records at session end."""

    def __init__(self, directory: str, run_id: str, worker: str) -> None:
        self.path = Path(directory) / f"process-{run_id}-{worker}-{os.getpid()}.json"
        self.marks: dict[str, float] = {}
        started = process_start_time()
        if started is not None:
            self.marks["started"] = started
        self.mark("configured")

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.time())

    def pytest_collection_finish(self, session: Any) -> None:
        self.mark("collected")

    def pytest_sessionfinish(self, session: Any) -> None:
        self.mark("finished")
        with contextlib.suppress(OSError):  # timing is a nicety; never a test failure
            self.path.write_text(json.dumps(self.marks) + "\n", encoding="utf-8")


def read_marks(directories: Iterable[Path]) -> list[dict[str, float]]:
    found = []
    for directory in directories:
        for path in sorted(Path(directory).glob(MARKS_GLOB)):
            try:
                found.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
    return found


def process_phase_seconds(
    marks: Sequence[Mapping[str, float]], rows: Iterable[Mapping[str, Any]]
) -> dict[str, float]:
    """Seconds summed over processes: start-up phases from `marks`, then the tests'
    setup, call and teardown from the records (the first test's setup usually holds
    CUDA initialization when neighbours are off)."""
    totals = dict.fromkeys([*PROCESS_PHASES, "setup", "call", "teardown", "other"], 0.0)
    for m in marks:
        for phase, (start, stop) in PROCESS_PHASES.items():
            if start in m and stop in m:
                totals[phase] += max(0.0, m[stop] - m[start])
    for row in rows:
        phase = str(row.get("phase"))
        if phase in ("setup", "call", "teardown"):
            totals[phase] += float(row.get("duration") or 0.0)
    accounted = sum(totals.values())
    lifetime = sum(
        m["finished"] - m.get("started", m["configured"]) for m in marks if "finished" in m
    )
    totals["other"] = max(0.0, lifetime - accounted)
    return {k: round(v, 3) for k, v in totals.items()}


class SweepClock:
    """Wall time of each sweep phase (runs, isolation, attribution, searches, reports)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.monotonic() - start, 3)


def summary_times(
    clock: SweepClock, raw: Path, rows: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """`phase_times` of summary.json: sweep phases (wall), processes' phases (summed)."""
    directories = [p for p in raw.iterdir() if p.is_dir()] if raw.is_dir() else []
    marks = read_marks(directories)
    return {
        "sweep_s": dict(clock.seconds),
        "processes": len(marks),
        "process_s": process_phase_seconds(marks, rows),
    }
