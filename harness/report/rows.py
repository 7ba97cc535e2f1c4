"""One read of a sweep's rows for all of its reports.

The rows stay on disk under raw/ (harness.sweep.store), and each report used to read them
all back for itself: the phase times, the outcome counts, the placement and GPU sections,
records.jsonl and the per-test outcome column, seven reads of every row at the end of a
sweep (14.6 s of a 2,000-test synthetic sweep, about one plain run of the suite).
`ReportRows.add` takes each process's rows once, as the sweep takes the process
(harness.sweep.store), writes them to records.jsonl, and keeps only what the reports ask
of them: summed test phase times, each attempt's outcome (the fold's own compact form,
run -> test -> outcome), the few rows that carry a message or a leak, and the attempts
pinned to a GPU. Reading every row back from raw/ at the end instead took 0.7 s of a
2,000-test synthetic sweep's report (issue 21).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import pandas as pd  # type: ignore[import-untyped]

from ..records import Outcome, Record, Signal, fold_outcome, to_json
from ..verdicts import fold
from . import tables

TEST_PHASES = ("setup", "call", "teardown")


@dataclass
class ReportRows:
    """What the reports need of every row of a sweep (`add` fills it)."""

    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TEST_PHASES, 0.0))
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)  # run -> test ->
    said: list[dict[str, Any]] = field(default_factory=list)  # rows with a message or a leak
    flagged: list[Record] = field(default_factory=list)  # frozen config or a leak: the GPU section
    pinned: list[fold.Attempt] = field(default_factory=list)  # attempts pinned to one GPU

    def phase_rows(self) -> list[dict[str, Any]]:
        """The test phases' summed seconds as rows: all that phase_times reads of a row."""
        return [{"phase": phase, "duration": seconds} for phase, seconds in self.phase_s.items()]

    def worst(self) -> dict[str, Outcome]:
        """Each test's outcome over all its attempts: the first of OUTCOMES among them."""
        return tables.worst_outcomes(self.outcomes)

    def table(self) -> pd.DataFrame:
        """The per-test outcome columns (tables.outcomes_by_test's frame)."""
        return tables.outcomes_table(self.outcomes, self.said)

    def add(self, end: fold.RunOutcome, rows: Sequence[Record], records: IO[str] | None) -> None:
        """What the reports ask of one process's rows (how it ended, its rows), each row
        written to `records` (records.jsonl). Built apart and joined last, so that an
        interrupt while a whole suite run's rows are read leaves none of them half in."""
        part = ReportRows()
        text = "".join(to_json(row) + "\n" for row in rows) if records is not None else ""
        for row in rows:
            _take(part, row)
        outcomes = fold.attempt_outcomes(rows, [end])
        pinned = []
        if end.gpu or any(r.get("gpu") for r in rows):
            pinned = [a for a in fold.attempts(rows, [end]).values() if a.gpu]
        for phase, seconds in part.phase_s.items():
            self.phase_s[phase] += seconds
        for run, per_test in outcomes.items():
            known = self.outcomes.setdefault(run, {})  # a run id is one process's
            for nodeid, outcome in per_test.items():
                had = known.get(nodeid)
                known[nodeid] = outcome if had is None else fold_outcome((had, outcome))
        self.said += part.said
        self.flagged += part.flagged
        self.pinned += pinned
        if records is not None:
            records.write(text)


def _take(found: ReportRows, row: Record) -> None:
    phase = row.get("phase")
    if phase in found.phase_s:
        found.phase_s[phase] += float(row.get("duration") or 0.0)
    said = tables.said_row(row)
    if said is not None:
        found.said.append(said)
    if row.get("env_leak") or Signal.FROZEN_CONFIG in row.get("signals", ()):
        found.flagged.append(row)
