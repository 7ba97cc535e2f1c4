"""The one fold of a test's phase rows in one process into an `Attempt`.

A test's rows in one process (setup, call, teardown, plus the xdist controller's
crash row) collapse into one `Attempt`: it failed when any phase failed, or when a
crash or timeout signal is on any of its rows; its outcome is the first of the record
format's OUTCOMES among its phases. Every reader that asks "did this test fail here, and
how" (the evidence, the replays' outcomes, the heat map, failures by GPU, the per-test
outcome column) asks an `Attempt`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..records import Outcome, Record, Signal, fold_outcome

UNFINISHED_MESSAGE = "the test process died while this test ran"
STALLED_MESSAGE = "the test process made no progress for {seconds:g}s and was killed"


@dataclass(frozen=True)
class Attempt:
    """One test's run in one process: all its phase rows folded together."""

    nodeid: str
    run_id: str
    failed: bool
    signals: frozenset[str]
    worker: str
    pid: int
    index: int
    start: float  # time of its first row: orders tests across processes
    seed: int | None
    message: str
    stop: float = 0.0  # when its last phase ended: with `start`, who ran at the same time
    outcome: Outcome = "passed"  # what pytest said of it: the first of OUTCOMES among its phases
    gpu: str = ""  # the one device its process was pinned to, "" if none


def attempts(rows: Iterable[Record]) -> dict[tuple[str, str], Attempt]:
    """Fold rows into one Attempt per (run_id, nodeid)."""
    grouped: dict[tuple[str, str], list[Record]] = {}
    for row in rows:
        grouped.setdefault((row["run_id"], row["nodeid"]), []).append(row)
    return {key: _fold(group) for key, group in grouped.items()}


def _fold(rows: list[Record]) -> Attempt:
    # The test process's own rows know its position; the controller's crash row
    # may come from another pid, so prefer the rows that carry an index it ran at.
    own = [r for r in rows if Signal.CRASH not in r["signals"]] or rows
    first = min(own, key=lambda r: r["time"])
    failing = [r for r in rows if _failed(r)]
    return Attempt(
        nodeid=first["nodeid"],
        run_id=first["run_id"],
        failed=bool(failing),
        signals=frozenset(s for r in rows for s in r["signals"]),
        worker=first["worker"],
        pid=first["pid"],
        index=first["index"],
        start=min(r["time"] for r in rows),
        seed=first["seed"],
        message=next((r["message"] for r in failing if r["message"]), ""),
        stop=max(float(r.get("stop", r["time"])) for r in rows),
        outcome=fold_outcome(r["outcome"] for r in rows),
        gpu=next((r["gpu"] for r in rows if r.get("gpu")), ""),
    )


def _failed(row: Record) -> bool:
    return row["outcome"] == "failed" or bool({Signal.CRASH, Signal.TIMEOUT} & set(row["signals"]))


def unfinished(rows: Sequence[Record]) -> list[list[Record]]:
    """Each test's rows in one process where setup was seen and teardown never was."""
    by_test: dict[tuple[str, str, int], list[Record]] = {}
    for row in rows:
        by_test.setdefault((row["run_id"], row["nodeid"], row["pid"]), []).append(row)
    return [
        group
        for group in by_test.values()
        if not any(r["phase"] == "teardown" or Signal.CRASH in r["signals"] for r in group)
    ]


def unfinished_rows(rows: Sequence[Record], *, stalled_after: float | None = None) -> list[Record]:
    """Rows to add for tests whose process ended mid-test.

    Without xdist no controller survives to report a dead process, so the
    sweep reads the death off the rows: such a test crashed, or, when the sweep
    killed a stalled process (`stalled_after` seconds without progress), timed out.
    """
    signal = Signal.CRASH if stalled_after is None else Signal.TIMEOUT
    message = (
        UNFINISHED_MESSAGE
        if stalled_after is None
        else STALLED_MESSAGE.format(seconds=stalled_after)
    )
    added: list[Record] = []
    for group in unfinished(rows):
        last = max(group, key=lambda r: r["time"])
        signals = sorted({*last["signals"], signal})
        added.append(
            {**last, "phase": "call", "outcome": "failed", "duration": 0.0, "signals": signals,
             "message": message}
        )  # fmt: skip
    return added


def finished_rows(rows: Sequence[Record]) -> list[Record]:
    """`rows` without the tests that were cut off mid-run (by Ctrl-C: no verdict on them)."""
    cut = {id(r) for group in unfinished(rows) for r in group}
    return [r for r in rows if id(r) not in cut]


def process_sequence(every: dict[tuple[str, str], Attempt], victim: Attempt) -> list[str]:
    """The tests that ran before `victim` in its own process, in order."""
    same = [
        a
        for a in every.values()
        if a.run_id == victim.run_id
        and a.worker == victim.worker
        and a.pid == victim.pid
        and a.index < victim.index
    ]
    return [a.nodeid for a in sorted(same, key=lambda a: a.index)]


def run_sequence(every: dict[tuple[str, str], Attempt], victim: Attempt) -> list[str]:
    """The tests that started before `victim` in its run, in any process, by start time.

    The wider net for causes that cross processes (a file left in a shared directory).
    """
    before = [
        a
        for a in every.values()
        if a.run_id == victim.run_id and a.start < victim.start and a.nodeid != victim.nodeid
    ]
    return [a.nodeid for a in sorted(before, key=lambda a: a.start)]


def concurrent_with(every: dict[tuple[str, str], Attempt], victim: Attempt) -> list[str]:
    """The tests of other workers of the victim's run whose run overlapped the victim's."""
    return sorted(
        a.nodeid
        for a in every.values()
        if a.run_id == victim.run_id
        and a.worker != victim.worker
        and a.nodeid != victim.nodeid
        and a.start < victim.stop
        and victim.start < a.stop
    )
