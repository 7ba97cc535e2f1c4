"""The evidence store holds no test process's rows: reports read them back from raw/."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from typing import cast

import pytest

from capsafe_harness.records import Record, records_path, to_json
from capsafe_harness.report import rows as rows_module
from capsafe_harness.sweep.runner import ProcessResult
from capsafe_harness.sweep.store import EvidenceStore
from capsafe_harness.verdicts import fold


def _rows(label: str, tests: int) -> list[Record]:
    return [
        cast(
            Record,
            {
                "nodeid": f"test_m.py::test_{t}",
                "phase": phase,
                "outcome": "passed",
                "duration": 0.01,
                "run_id": label,
                "seed": 1,
                "worker": "main",
                "index": t,
                "pid": 10,
                "signals": [],
                "message": "",
                "time": float(t),
            },
        )
        for t in range(tests)
        for phase in ("setup", "call", "teardown")
    ]


def _process(raw: Path, label: str, tests: int, *, on_disk: bool = True) -> ProcessResult:
    """A finished process: its rows written under raw/label as the plugin writes them."""
    rows = _rows(label, tests)
    path = records_path(raw / label, label, "main", 10)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(to_json(r) + "\n" for r in rows), encoding="utf-8")
    kept = rows if on_disk else rows[:3]  # Ctrl-C: only the first test finished
    return ProcessResult(label, kept, fold.RunOutcome(label, 0), raw / f"{label}.log",
                         on_disk=on_disk)  # fmt: skip


def _attempts(store: EvidenceStore) -> list[fold.Attempt]:
    """Every attempt of every taken process, folded one process at a time."""
    return [a for end, rows in store.processes_rows() for a in fold.attempts(rows, [end]).values()]


def test_rows_and_attempts_are_read_back_from_the_records(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, 60.0)
    store.take(_process(tmp_path, "run-1", 4))
    store.take(_process(tmp_path, "alone-2", 2))
    rows = store.rows()
    labels = [r["run_id"] for r in rows]
    assert labels == ["run-1"] * 12 + ["alone-2"] * 6  # in the order taken
    assert len(list(rows)) == len(list(rows)) == 18  # iterable again: each time from disk
    assert sorted((a.run_id, a.nodeid) for a in _attempts(store)) == sorted(
        [("run-1", f"test_m.py::test_{t}") for t in range(4)]
        + [("alone-2", f"test_m.py::test_{t}") for t in range(2)]
    )


def test_a_process_cut_off_by_ctrl_c_keeps_only_its_finished_rows(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, 60.0)
    store.take(_process(tmp_path, "run-1", 4, on_disk=False))
    assert [r["nodeid"] for r in store.rows()] == ["test_m.py::test_0"] * 3


def test_the_store_does_not_grow_with_the_rows_it_took(tmp_path: Path) -> None:
    """Taking 40 processes of 300 tests each leaves the store holding a few bytes per
    process, not the 36,000 rows (a dict each: about 25 MB held by the old store)."""
    results = [_process(tmp_path, f"run-{k}", 300) for k in range(1, 41)]
    store = EvidenceStore(tmp_path, 60.0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        while results:
            store.take(results.pop())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, f"the store holds {held} bytes after taking 36,000 rows"
    assert sum(1 for _ in store.rows()) == 36_000


def test_attempts_of_every_run_share_their_test_s_strings_and_empty_signals(
    tmp_path: Path,
) -> None:
    """The store keeps an attempt per test per suite run: node id, run id and worker are
    one string each however many runs read them, and a passing test's signals one set."""
    store = EvidenceStore(tmp_path, 60.0)
    for k in (1, 2):
        store.take(_process(tmp_path, f"run-{k}", 2))
    first, last = [a for a in _attempts(store) if a.nodeid == "test_m.py::test_1"]
    assert (first.run_id, last.run_id) == ("run-1", "run-2")
    assert first.nodeid is last.nodeid
    assert first.worker is last.worker
    assert first.signals is last.signals is fold.NO_SIGNALS


def test_the_reports_rows_are_taken_with_each_process_and_written_once(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    store = EvidenceStore(tmp_path, 60.0, records)
    store.take(_process(tmp_path, "run-1", 4))
    store.take(_process(tmp_path, "alone-2", 2))
    store.close_records()
    taken = records.read_text(encoding="utf-8").splitlines()
    assert taken == [to_json(r) for r in [*_rows("run-1", 4), *_rows("alone-2", 2)]]
    assert store.report.outcomes == {
        "run-1": {f"test_m.py::test_{t}": "passed" for t in range(4)},
        "alone-2": {f"test_m.py::test_{t}": "passed" for t in range(2)},
    }
    assert store.report.phase_s == {"setup": 0.06, "call": 0.06, "teardown": 0.06}


def test_ctrl_c_while_a_process_is_taken_leaves_none_of_it_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A suite run's thousands of rows are read on the main thread: Ctrl-C may land there.
    records = tmp_path / "records.jsonl"
    store = EvidenceStore(tmp_path, 60.0, records)
    store.take(_process(tmp_path, "run-1", 2))
    calls = 0

    def interrupted(record: Record) -> str:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise KeyboardInterrupt
        return to_json(record)

    monkeypatch.setattr(rows_module, "to_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.take(_process(tmp_path, "run-2", 2))
    monkeypatch.undo()
    store.close_records()
    assert [end.run_id for end in store.ends] == ["run-1"]
    assert list(store.report.outcomes) == ["run-1"]
    assert store.report.phase_s["call"] == 0.02
    assert len(records.read_text(encoding="utf-8").splitlines()) == 6
