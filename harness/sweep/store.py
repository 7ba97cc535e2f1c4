"""The sweep's one evidence store: what every phase adds to, and the verdicts read.

The phases (harness.sweep.runs, .isolation, .searches, .parallel, .capture_sweep) share
one `EvidenceStore`, so an interruption at any point still reports all that was
learned, and --resume and `capsafe merge` rebuild it from the records.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..records import Record
from ..report.summary import SearchRecord
from ..verdicts import fold
from ..verdicts.evidence import Evidence
from .runner import ProcessResult


class EvidenceStore:
    """Every test's evidence, the rows and ends of every process, the searches and notes.

    `lock` guards it: the phases add to it from the pool's threads."""

    def __init__(self, raw: Path, stall_limit: float) -> None:
        self.raw = raw
        self.stall_limit = stall_limit
        self.lock = threading.RLock()
        self.evidence: dict[str, Evidence] = {}
        self.collected: tuple[str, ...] = ()
        self.rows: list[Record] = []  # what the test processes recorded
        self.ends: list[fold.RunOutcome] = []  # how each of them ended
        self.processes: dict[str, dict[str, Any]] = {}  # label -> exit code, stalled, lost
        self.run_ids: list[str] = []
        self.seeds: list[int] = []
        self.shuffles: list[str] = []
        self.run_attempts: dict[tuple[str, str], fold.Attempt] = {}
        self.runs_done: set[int] = set()
        self.alone_done: dict[tuple[str, int], str] = {}  # (test, rerun) -> label that counts
        self.searches: list[SearchRecord] = []
        self.causes: list[tuple[str, tuple[str, ...]]] = []  # (kind, verified culprits)
        self.notes: list[str] = []
        self.suite_errors: list[dict[str, Any]] = []  # runs pytest failed with no test failing

    def ev(self, nodeid: str) -> Evidence:
        with self.lock:
            return self.evidence.setdefault(nodeid, Evidence(nodeid))

    def note(self, text: str) -> None:
        with self.lock:
            self.notes.append(text)

    def explained(self, nodeid: str) -> bool:
        """Has a cause (polluters, state-setters, concurrent tests) been found for it?"""
        with self.lock:
            ev = self.evidence.get(nodeid)
            return ev is not None and bool(ev.polluters or ev.state_setters or ev.concurrent)

    def take(self, result: ProcessResult) -> None:
        """A finished process's rows, how it ended, and what the notes say of it."""
        with self.lock:
            self.rows += result.rows
            self.ends.append(result.end)
            fact: dict[str, Any] = {"returncode": result.returncode, "stalled": result.stalled}
            if result.end.lost:
                fact["lost"] = result.end.lost
            self.processes[result.label] = fact
            if result.malformed:
                self.notes.append(
                    f"{result.label}: skipped {result.malformed} malformed record line(s) "
                    f"in {self.raw / result.label}"
                )
            if result.stalled:
                self.notes.append(f"{result.label}: {self.stall_text(result)}")

    def stall_text(self, result: ProcessResult) -> str:
        inside = result.killed_in
        where = (f"in {', '.join(inside)}, recorded as timed out" if inside else
                 "outside any test (in start-up, collection, between tests or after the "
                 "last one)")  # fmt: skip
        limit = result.end.stalled_after or self.stall_limit  # the runner's, for this process
        return f"no progress for {limit:g}s; the process was killed {where}"
