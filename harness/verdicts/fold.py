"""The one fold of a test's phase rows in one process into an `Attempt`.

A test's rows in one process (setup, call, teardown, plus the xdist controller's
crash row) collapse into one `Attempt`: it failed when any phase failed, or when a
crash or timeout signal is on any of its rows; its outcome is the first of the record
format's OUTCOMES among its phases. Every reader that asks "did this test fail here, and
how" (the evidence, the replays' outcomes, the heat map, failures by GPU, the per-test
outcome column) asks an `Attempt`.

How a process ended is a fact beside its rows, not rows made up to look recorded: a
`RunOutcome` (its exit code, the watchdog's kill, the executor's loss, the tests it was
in) is folded in with the rows, so a test its process died in is a failed attempt with
the crash (or, killed by the watchdog, the timeout) signal, and records.jsonl holds only
what test processes wrote.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..records import OUTCOMES, Outcome, Record, Signal, fold_outcome

_RANK = {outcome: rank for rank, outcome in enumerate(OUTCOMES)}  # fold_outcome's order
_PASSED = _RANK["passed"]  # what fold_outcome says when no phase said anything it knows
NO_SIGNALS: frozenset[str] = frozenset()  # shared by the attempts of every passing test
UNFINISHED_MESSAGE = "the test process died while this test ran"
STALLED_MESSAGE = "the test process made no progress for {seconds:g}s and was killed"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One test's run in one process: all its phase rows folded together. Slotted: a sweep
    holds one per test per suite run (42,000 for dateutil at 20 runs)."""

    nodeid: str
    run_id: str
    failed: bool
    signals: frozenset[str]
    worker: str
    pid: int
    index: int
    start: float  # when its first phase started: orders tests across processes
    seed: int | None
    message: str
    stop: float = 0.0  # when its last phase ended: with `start`, who ran at the same time
    outcome: Outcome = "passed"  # what pytest said of it: the first of OUTCOMES among its phases
    gpu: str = ""  # the one device its process was pinned to, "" if none
    capture_sites: tuple[str, ...] = ()  # where it began captures (file:line), in order
    capture_frameworks: tuple[str, ...] = ()  # what it captured through (the observer's names)
    left_open: tuple[str, ...] = ()  # of those, the ones still open when it ended
    left_global_open: bool = False  # one of those captured in GLOBAL mode: every later
    # capture of the process then fails its allocations, whatever the neighbours do
    thread_unsafe: str | None = None  # pytest-run-parallel's thread_unsafe marker's reason

    @property
    def leak_victim(self) -> bool:
        """Failed with a capture error while it began no capture: another test's capture,
        left open in its process, is what it ran into."""
        mine = Signal.FAILED_IN_CAPTURE in self.signals or bool(self.capture_sites)
        return self.failed and Signal.CAPTURE_INVALIDATED in self.signals and not mine


@dataclass(frozen=True)
class Killed:
    """A test its process was in when the process ended: set up, never torn down (and no
    crash row from xdist's controller), or, for a replay lost with no row of it, the
    test of its sequence it was in or about to start."""

    nodeid: str
    phase: str  # the last phase it recorded; "" when it recorded none
    index: int = -1  # its position in the replayed sequence, when it recorded no row
    at: float = 0.0  # when the sweep saw the process end, for a test with no row


@dataclass(frozen=True)
class RunOutcome:
    """How one test process ended, as the sweep saw it (harness.sweep.runner)."""

    run_id: str
    returncode: int
    stalled_after: float | None = None  # the watchdog killed it after so many silent seconds
    lost: str = ""  # why the executor lost it (a Ray node died, twice); "" when it did not
    killed: tuple[Killed, ...] = ()  # the tests it was in when it ended
    gpu: str = ""  # the one device it was pinned to, "" if none

    @property
    def stalled(self) -> bool:
        return self.stalled_after is not None

    @property
    def signal(self) -> Signal:
        """What a test it died in gets: timed out when the watchdog killed it, else crashed."""
        return Signal.CRASH if self.stalled_after is None else Signal.TIMEOUT

    @property
    def message(self) -> str:
        """The failure message of a test it died in."""
        if self.lost:
            return self.lost
        if self.stalled_after is None:
            return UNFINISHED_MESSAGE
        return STALLED_MESSAGE.format(seconds=self.stalled_after)


def attempts(
    rows: Iterable[Record], ends: Iterable[RunOutcome] = ()
) -> dict[tuple[str, str], Attempt]:
    """Fold rows into one Attempt per (run_id, nodeid), with how their processes ended."""
    grouped: dict[tuple[str, str], list[Record]] = {}
    for row in rows:
        grouped.setdefault((row["run_id"], row["nodeid"]), []).append(row)
    died = {(end.run_id, k.nodeid): (end, k) for end in ends for k in end.killed}
    found = {key: _fold(group, died.get(key, (None, None))[0]) for key, group in grouped.items()}
    for key, (end, killed) in died.items():
        if key not in found:
            found[key] = _unrecorded(end, killed)
    return found


def attempt_outcomes(
    rows: Iterable[Record], ends: Iterable[RunOutcome] = ()
) -> dict[str, dict[str, Outcome]]:
    """run_id -> nodeid -> what pytest said of that attempt (its `Attempt.outcome`), folded
    row by row without keeping the rows: the report's outcome column over every process."""
    ranks: dict[str, dict[str, int]] = {}
    for row in rows:
        per_run = ranks.setdefault(row["run_id"], {})
        nodeid = sys.intern(row["nodeid"])
        rank = _RANK.get(row["outcome"], _PASSED)
        per_run[nodeid] = min(rank, per_run.get(nodeid, _PASSED))
    for end in ends:  # a test its process died in failed, whatever its rows say
        for k in end.killed:
            ranks.setdefault(end.run_id, {})[k.nodeid] = _RANK["failed"]
    return {run: {n: OUTCOMES[r] for n, r in per.items()} for run, per in ranks.items()}


def _outcome(outcomes: Iterable[str], died: bool) -> Outcome:
    """An attempt's outcome: the first of OUTCOMES among its phases'; failed if its process
    died in it."""
    return fold_outcome([*outcomes, "failed"] if died else outcomes)


def _fold(rows: list[Record], died: RunOutcome | None) -> Attempt:
    # The test process's own rows know its position; the controller's crash row
    # may come from another pid, so prefer the rows that carry an index it ran at.
    own = [r for r in rows if Signal.CRASH not in r["signals"]] or rows
    first = min(own, key=lambda r: r["time"])
    failing = [r for r in rows if _failed(r)]
    signals = {s for r in rows for s in r["signals"]}
    message = next((r["message"] for r in failing if r["message"]), "")
    captures = [c for r in rows for c in r.get("captures", ())]
    marked = next((r["thread_unsafe"] for r in rows if "thread_unsafe" in r), None)
    if died is not None:  # its process ended while it ran
        signals.add(died.signal)
        message = message or died.message
    return Attempt(
        nodeid=sys.intern(first["nodeid"]),  # one string per test, not per run (memory)
        run_id=sys.intern(first["run_id"]),
        failed=bool(failing) or died is not None,
        signals=frozenset(signals) if signals else NO_SIGNALS,  # 216 bytes each otherwise
        worker=sys.intern(first["worker"]),
        pid=first["pid"],
        index=first["index"],
        start=min(float(r.get("start", r["time"])) for r in rows),  # setup's own start
        seed=first["seed"],
        message=message,
        stop=max(float(r.get("stop", r["time"])) for r in rows),
        outcome=_outcome((r["outcome"] for r in rows), died is not None),
        gpu=next((r["gpu"] for r in rows if r.get("gpu")), ""),
        capture_sites=tuple(c["site"] for c in captures),
        capture_frameworks=tuple(dict.fromkeys(sys.intern(c["framework"]) for c in captures)),
        left_open=tuple(c["site"] for c in captures if c["open"]),
        left_global_open=any(c["open"] and c.get("mode") == "global" for c in captures),
        thread_unsafe=marked,
    )


def _unrecorded(end: RunOutcome, killed: Killed) -> Attempt:
    """A test of a lost replay that recorded nothing: crashed where the process ended."""
    return Attempt(
        nodeid=killed.nodeid, run_id=end.run_id, failed=True, signals=frozenset({end.signal}),
        worker="main", pid=0, index=killed.index, start=killed.at, seed=None,
        message=end.message, stop=killed.at, outcome="failed", gpu=end.gpu,
    )  # fmt: skip


def failures_by_run(rows: Iterable[Record]) -> dict[str, tuple[bool, ...]]:
    """Each test of one process: did each of its runs fail, in the order they ran. A test the
    process ran more than once (the cause before each block of a screen, the victim after
    it) is one attempt, failed if any run did; this keeps the runs apart."""
    runs: dict[str, dict[int, bool]] = {}
    for row in rows:
        mine = runs.setdefault(row["nodeid"], {})
        index = int(row.get("index", -1))
        mine[index] = mine.get(index, False) or _failed(row)
    return {n: tuple(failed for _, failed in sorted(by.items())) for n, by in runs.items()}


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


def killed(rows: Sequence[Record]) -> tuple[Killed, ...]:
    """The tests a process's rows show it was in when it ended, each with its last phase.

    Without xdist no controller survives to report a dead process, so where it died is
    read off its rows: set up, never torn down.
    """
    return tuple(
        Killed(group[0]["nodeid"], max(group, key=lambda r: r["time"])["phase"])
        for group in unfinished(rows)
    )


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
