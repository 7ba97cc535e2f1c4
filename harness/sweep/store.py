"""The sweep's one evidence store: what every phase adds to, and the verdicts read.

The phases (harness.sweep.runs, .isolation, .searches, .parallel, .capture_sweep) share
one `EvidenceStore`, so an interruption at any point still reports all that was
learned, and --resume and `capsafe merge` rebuild it from the records.

The store holds no test process's rows: they stay in their records under raw/, and
`processes_rows()` reads them back one process at a time (the fixes phase); what the
reports need of them is kept as each process is taken (harness.report.rows), and the rows
written to records.jsonl then.
Holding them (a dict per row, three rows per test per run) made a sweep's memory grow
with its runs: python-dateutil's 2,095 tests took 170 MB at 5 runs and 414 MB at 20.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ..records import Record, load_records
from ..report.rows import ReportRows
from ..report.summary import SearchRecord
from ..verdicts import fold
from ..verdicts.evidence import Evidence
from .runner import ProcessResult


class EvidenceStore:
    """Every test's evidence, the rows and ends of every process, the searches and notes.

    `lock` guards it: the phases add to it from the pool's threads."""

    def __init__(self, raw: Path, stall_limit: float, records: Path | None = None) -> None:
        """`records`: records.jsonl, each taken process's rows written there as taken."""
        self.raw = raw
        self.stall_limit = stall_limit
        self.report = ReportRows()  # what the reports need of every row taken so far
        self._records_path = records
        self._records: IO[str] | None = None
        self.lock = threading.RLock()
        self.evidence: dict[str, Evidence] = {}
        self.collected: tuple[str, ...] = ()
        self.ends: list[fold.RunOutcome] = []  # how each test process taken ended, in order
        self._held: dict[str, list[Record]] = {}  # rows not as on disk: a run Ctrl-C cut off
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
            if self._records is None and self._records_path is not None:
                self._records = open(self._records_path, "w", encoding="utf-8")  # noqa: SIM115
            self.report.add(result.end, result.rows, self._records)  # first: the long part
            if not result.on_disk:
                self._held[result.label] = result.rows
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

    def close_records(self) -> None:
        """records.jsonl is complete (empty where no process ran): every process the
        reports cover was taken; later ones are not written."""
        with self.lock:
            if self._records is None and self._records_path is not None:
                self._records = open(self._records_path, "w", encoding="utf-8")  # noqa: SIM115
            if self._records is not None:
                self._records.close()
            self._records = self._records_path = None

    def rows(self) -> RowStream:
        """Every taken process's rows, in the order taken, read back from raw/ as iterated."""
        return RowStream(self)

    def processes_rows(self) -> Iterator[tuple[fold.RunOutcome, list[Record]]]:
        """Each taken process (how it ended) with its rows, one process in memory at a time."""
        with self.lock:
            ends = list(self.ends)
        for end in ends:
            held = self._held.get(end.run_id)
            yield end, held if held is not None else load_records(self.raw / end.run_id)[0]

    def stall_text(self, result: ProcessResult) -> str:
        inside = result.killed_in
        where = (f"in {', '.join(inside)}, recorded as timed out" if inside else
                 "outside any test (in start-up, collection, between tests or after the "
                 "last one)")  # fmt: skip
        limit = result.end.stalled_after or self.stall_limit  # the runner's, for this process
        return f"no progress for {limit:g}s; the process was killed {where}"


class RowStream:
    """The rows of a store's processes: iterable again and again, each time from disk."""

    def __init__(self, store: EvidenceStore) -> None:
        self.store = store

    def __iter__(self) -> Iterator[Record]:
        for _, rows in self.store.processes_rows():
            yield from rows
