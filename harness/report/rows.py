"""One read of a sweep's rows for all of its reports.

The rows stay on disk under raw/ (harness.sweep.store), and each report used to read them
all back for itself: the phase times, the outcome counts, the placement and GPU sections,
records.jsonl and the per-test outcome column, seven reads of every row at the end of a
sweep (14.6 s of a 2,000-test synthetic sweep, about one plain run of the suite).
`read_rows` reads each process's rows once, writes records.jsonl as it goes, and keeps only
what the reports ask of the rows: summed test phase times, each attempt's outcome (the
fold's own compact form, run -> test -> outcome), the few rows that carry a message or a
leak, and the attempts pinned to a GPU. One process's rows are in memory at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd  # type: ignore[import-untyped]

from ..records import Outcome, Record, Signal, fold_outcome, to_json
from ..verdicts import fold
from . import tables

TEST_PHASES = ("setup", "call", "teardown")


@dataclass
class ReportRows:
    """What the reports need of every row of a sweep (`read_rows` fills it)."""

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


def read_rows(
    processes: Iterable[tuple[fold.RunOutcome, Sequence[Record]]], records: Path | None = None
) -> ReportRows:
    """Everything the reports ask of `processes`' rows (each process: how it ended, its rows),
    read once; each row written to `records` (records.jsonl) on the way."""
    found = ReportRows()
    with open(records, "w", encoding="utf-8") if records else contextlib.nullcontext() as out:
        for end, rows in processes:
            for row in rows:
                if out is not None:
                    out.write(to_json(row) + "\n")
                _take(found, row)
            for run, per_test in fold.attempt_outcomes(rows, [end]).items():
                known = found.outcomes.setdefault(run, {})  # a run id is one process's
                for nodeid, outcome in per_test.items():
                    had = known.get(nodeid)
                    known[nodeid] = outcome if had is None else fold_outcome((had, outcome))
            if end.gpu or any(r.get("gpu") for r in rows):
                found.pinned += [a for a in fold.attempts(rows, [end]).values() if a.gpu]
    return found


def _take(found: ReportRows, row: Record) -> None:
    phase = row.get("phase")
    if phase in found.phase_s:
        found.phase_s[phase] += float(row.get("duration") or 0.0)
    said = tables.said_row(row)
    if said is not None:
        found.said.append(said)
    if row.get("env_leak") or Signal.FROZEN_CONFIG in row.get("signals", ()):
        found.flagged.append(row)
