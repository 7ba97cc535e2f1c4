"""From raw phase rows to one verdict per test.

A test's rows in one process (setup, call, teardown, plus the xdist
controller's crash row) collapse into one `Attempt`: it failed when any phase
failed. What the sweep learned about a test across all its processes is its
`Evidence`; `RULES` turns that into exactly one class: the first rule whose
evidence holds wins, so a new class slots in as one row at the place its
evidence must be checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..records import Record

CLASSES = (
    "error",
    "fail",
    "capture-unsafe",
    "order-dependent",
    "brittle",
    "parallel-unsafe",
    "flaky",
    "unverified",
    "pass",
)
"""Every classification, worst first: the order the report sorts by."""

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


def attempts(rows: Iterable[Record]) -> dict[tuple[str, str], Attempt]:
    """Fold rows into one Attempt per (run_id, nodeid)."""
    grouped: dict[tuple[str, str], list[Record]] = {}
    for row in rows:
        grouped.setdefault((row["run_id"], row["nodeid"]), []).append(row)
    return {key: _fold(group) for key, group in grouped.items()}


def _fold(rows: list[Record]) -> Attempt:
    # The test process's own rows know its position; the controller's crash row
    # may come from another pid, so prefer the rows that carry an index it ran at.
    own = [r for r in rows if "crash" not in r["signals"]] or rows
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
    )


def _failed(row: Record) -> bool:
    return row["outcome"] == "failed" or bool({"crash", "timeout"} & set(row["signals"]))


def _unfinished(rows: Sequence[Record]) -> list[list[Record]]:
    """Each test's rows in one process where setup was seen and teardown never was."""
    by_test: dict[tuple[str, str, int], list[Record]] = {}
    for row in rows:
        by_test.setdefault((row["run_id"], row["nodeid"], row["pid"]), []).append(row)
    return [
        group
        for group in by_test.values()
        if not any(r["phase"] == "teardown" or "crash" in r["signals"] for r in group)
    ]


def unfinished_rows(rows: Sequence[Record], *, stalled_after: float | None = None) -> list[Record]:
    """Rows to add for tests whose process ended mid-test.

    Without xdist no controller survives to report a dead process, so the
    sweep reads the death off the rows: such a test crashed, or, when the sweep
    killed a stalled process (`stalled_after` seconds without progress), timed out.
    """
    signal = "crash" if stalled_after is None else "timeout"
    message = (
        UNFINISHED_MESSAGE
        if stalled_after is None
        else STALLED_MESSAGE.format(seconds=stalled_after)
    )
    added: list[Record] = []
    for group in _unfinished(rows):
        last = max(group, key=lambda r: r["time"])
        signals = sorted({*last["signals"], signal})
        added.append(
            {**last, "phase": "call", "outcome": "failed", "duration": 0.0, "signals": signals,
             "message": message}
        )  # fmt: skip
    return added


def finished_rows(rows: Sequence[Record]) -> list[Record]:
    """`rows` without the tests that were cut off mid-run (by Ctrl-C: no verdict on them)."""
    cut = {id(r) for group in _unfinished(rows) for r in group}
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


@dataclass
class Evidence:
    """What the sweep learned about one test, filled in phase by phase.

    `polluters` and `state_setters` hold only causes verified K times; a cause a
    search found that did not verify is kept in `unconfirmed`.
    """

    nodeid: str
    runs: int = 0
    failures: int = 0
    isolation_runs: int = 0
    isolation_failures: int = 0
    polluters: list[str] = field(default_factory=list)
    state_setters: list[str] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)
    concurrent: list[str] = field(default_factory=list)  # set only when parallel-unsafe holds
    collides_with: list[str] = field(default_factory=list)  # of `concurrent`: confirmed K times
    collect_error: str | None = None
    capture_unsafe: bool = False  # set from harness.capture_sweep before classifying
    budget_cut: bool = False  # --budget stopped a rerun, search or verification it needed
    signals: set[str] = field(default_factory=set)
    message: str = ""

    @property
    def ran(self) -> bool:
        return self.runs > 0 or self.isolation_runs > 0

    @property
    def ever_failed_alone(self) -> bool:
        return self.isolation_failures > 0

    @property
    def always_failed_alone(self) -> bool:
        return self.isolation_runs > 0 and self.isolation_failures == self.isolation_runs


@dataclass(frozen=True)
class Rule:
    """One class and the evidence that puts a test in it (checked in RULES order)."""

    name: str
    holds: Callable[[Evidence], bool]
    evidence: str  # the rule, in words, for the docs and `capsafe sweep --help`


RULES: tuple[Rule, ...] = (
    Rule("error", lambda e: e.collect_error is not None,
         "pytest could not collect it (import or syntax error): no test of it ran"),
    Rule("pass", lambda e: e.ran and e.failures == 0 and e.isolation_failures == 0
         and not e.polluters,
         "ran, and never failed, in the suite or alone"),
    Rule("capture-unsafe", lambda e: e.capture_unsafe,
         "failed with a capture error in runs with neighbour threads, passed in every run "
         "without them (needs --neighbors); never sent to a cause search"),
    Rule("unverified",
         lambda e: (e.isolation_runs == 0 or e.budget_cut)
         and not (e.polluters or e.state_setters),
         "never ran (no suite run reached it), or failed, but its reruns alone could not "
         "run, or --budget ran out before the reruns, search or verification it needed"),
    Rule("brittle", lambda e: e.always_failed_alone and bool(e.state_setters),
         "fails alone every time; passes after its state-setter every time (K replays each)"),
    Rule("order-dependent", lambda e: not e.ever_failed_alone and bool(e.polluters),
         "never failed alone; fails after its polluter(s) every time (K replays each)"),
    Rule("fail", lambda e: e.always_failed_alone and e.failures == e.runs,
         "failed every time: in every suite run and every rerun alone"),
    Rule("parallel-unsafe", lambda e: not e.ever_failed_alone and bool(e.concurrent),
         "failed only while other workers ran; never alone, nor when its worker's sequence "
         "was replayed in one process (K times)"),
    Rule("flaky", lambda e: True,
         "anything else: fails only sometimes, or its cause did not verify"),
)  # fmt: skip


def classify(evidence: Evidence) -> str:
    """The one class a test's evidence puts it in: the first rule of RULES that holds."""
    return next(rule.name for rule in RULES if rule.holds(evidence))


def severity(classification: str) -> int:
    """Sort key: 0 for the worst class."""
    return CLASSES.index(classification)
