"""The one read of a sweep's rows (harness.report.rows) says what each report's own read of
every row says: phase times, outcomes, placement, the GPU section and records.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pandas as pd  # type: ignore[import-untyped]

from capsafe_harness.plugin.phase_times import process_phase_seconds
from capsafe_harness.records import Record, fold_outcome, to_json
from capsafe_harness.report import gpu_report, placement, tables
from capsafe_harness.report.rows import ReportRows
from capsafe_harness.verdicts import fold

FROZEN = (
    "FrozenConfigError: changed after it froze:\n  CUDA_MODULE_LOADING: frozen unset, now 'LAZY'\n"
)


def row(nodeid: str, phase: str, run: str, outcome: str = "passed", **kw: Any) -> Record:
    at = float(len(nodeid) + len(phase) + len(run))  # distinct enough for `time` ordering
    fields = {"nodeid": nodeid, "phase": phase, "outcome": outcome, "duration": 0.25 + at / 1000,
              "run_id": run, "seed": 1, "worker": "gw0", "index": 0, "pid": 7, "signals": [],
              "message": "", "details": "", "start": at, "stop": at + 0.1, "time": at + 0.1,
              "gpu": ""}  # fmt: skip
    return cast(Record, {**fields, **kw})


def phases_of(nodeid: str, run: str, call: str = "passed", **kw: Any) -> list[Record]:
    message = {"failed": "assert 1 == 2", "skipped": "Skipped: no GPU"}.get(call, "")
    return [row(nodeid, "setup", run, **kw), row(nodeid, "call", run, call, message=message, **kw),
            row(nodeid, "teardown", run, **kw)]  # fmt: skip


PROCESSES: list[tuple[fold.RunOutcome, list[Record]]] = [
    (fold.RunOutcome("run-1", 1), [
        *phases_of("t.py::test_a", "run-1"),
        *phases_of("t.py::test_skip", "run-1", "skipped"),
        *phases_of("t.py::test_victim", "run-1", "failed"),
        row("t.py::test_env", "teardown", "run-1", signals=["env-leak"],
            env_leak={"CUDA_VISIBLE_DEVICES": [None, "1"], "HOME": ["/a", "/b"]}),
        row("t.py::test_cfg", "call", "run-1", "failed", signals=["frozen-config"],
            message=FROZEN.splitlines()[0], details=FROZEN),
    ]),
    (fold.RunOutcome("alone-2", -9, killed=(fold.Killed("t.py::test_died", "setup"),), gpu="1"), [
        *phases_of("t.py::test_a", "alone-2", gpu="1"),
        row("t.py::test_died", "setup", "alone-2", gpu="1"),
    ]),
    (fold.RunOutcome("alone-3", 0, gpu="0"), [
        *phases_of("t.py::test_a", "alone-3", "failed", gpu="0"),
        *phases_of("t.py::test_skip", "alone-3", gpu="0"),
    ]),
]  # fmt: skip
ROWS = [r for _, rows in PROCESSES for r in rows]
ENDS = [end for end, _ in PROCESSES]
TESTS = [{"nodeid": "t.py::test_cfg", "classification": "fail"}]


def test_one_read_says_what_every_report_read_of_the_rows_says(tmp_path: Path) -> None:
    read = ReportRows()
    with open(tmp_path / "records.jsonl", "w", encoding="utf-8") as records:
        for end, rows in PROCESSES:
            read.add(end, rows, records)
    every = [a for end, rows in PROCESSES for a in fold.attempts(rows, [end]).values()]

    assert process_phase_seconds([], read.phase_rows()) == process_phase_seconds([], ROWS)
    pd.testing.assert_frame_equal(read.table(), tables.outcomes_by_test(ROWS, ENDS))
    by_test: dict[str, list[str]] = {}
    for a in every:
        by_test.setdefault(a.nodeid, []).append(a.outcome)
    assert read.worst() == {n: fold_outcome(o) for n, o in by_test.items()}
    assert read.worst()["t.py::test_died"] == "failed"  # its process died in it
    assert placement.placement_section(read.pinned) == placement.placement_section(every)
    assert placement.placement_section(read.pinned) is not None
    gpu = gpu_report.gpu_section(TESTS, read.flagged, None)
    assert gpu == gpu_report.gpu_section(TESTS, ROWS, None)
    assert gpu["frozen_config"] and gpu["env_leaks"]
    lines = (tmp_path / "records.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines == [to_json(r) for r in ROWS]
    assert json.loads(lines[0])["nodeid"] == "t.py::test_a"


def test_a_run_id_read_twice_folds_its_outcomes_as_one_run() -> None:
    """Two processes under one run id (never in a sweep, but the fold allows it): their
    attempts of one test fold into one, the worst outcome, as the flat fold does."""
    twice = [
        (fold.RunOutcome("run-1", 0), phases_of("t.py::test_a", "run-1", "skipped")),
        (fold.RunOutcome("run-1", 1), phases_of("t.py::test_a", "run-1", "failed")),
    ]
    flat = [r for _, rows in twice for r in rows]
    read = ReportRows()
    for end, rows in twice:
        read.add(end, rows, None)
    assert read.outcomes == fold.attempt_outcomes(flat) == {"run-1": {"t.py::test_a": "failed"}}
    pd.testing.assert_frame_equal(read.table(), tables.outcomes_by_test(flat))
