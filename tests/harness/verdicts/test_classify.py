"""Classification rules, folding phase rows into attempts, and the Wilson interval."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import pytest

from capsafe_harness.records import Record, Signal
from capsafe_harness.verdicts.catalogue import (
    CATALOGUE,
    CLASSES,
    Verdict,
    classify,
    docs_table,
    severity,
    why,
)
from capsafe_harness.verdicts.evidence import Evidence
from capsafe_harness.verdicts.fold import (
    Killed,
    RunOutcome,
    attempts,
    concurrent_with,
    killed,
    process_sequence,
    run_sequence,
)
from capsafe_harness.verdicts.stats import flake_rate, wilson_interval


def row(
    nodeid: str,
    phase: str = "call",
    outcome: str = "passed",
    *,
    run: str = "run-1",
    worker: str = "gw0",
    pid: int = 10,
    index: int = 0,
    signals: Iterable[str] = (),
    message: str = "",
    time: float = 0.0,
    seed: int = 7,
) -> Record:
    """A record of the first format (no details, start, stop or gpu), as classify reads it."""
    return cast(Record, {"nodeid": nodeid, "phase": phase, "outcome": outcome, "duration": 0.01,
            "run_id": run, "seed": seed, "worker": worker, "index": index, "pid": pid,
            "signals": list(signals), "message": message, "time": time})  # fmt: skip


def full(nodeid: str, outcome: str = "passed", **kw: Any) -> list[Record]:
    """The three phase rows of one test."""
    return [row(nodeid, p, outcome if p == "call" else "passed", **kw)
            for p in ("setup", "call", "teardown")]  # fmt: skip


# ---------------------------------------------------------------- rules


@pytest.mark.parametrize(
    ("evidence", "expected"),
    [
        (dict(runs=4, failures=0, isolation_runs=0, isolation_failures=0), "pass"),
        (dict(runs=3, failures=3, isolation_runs=3, isolation_failures=3), "fail"),
        (dict(runs=4, failures=1, isolation_runs=3, isolation_failures=3, state_setters=["s"]),
         "brittle"),
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=1), "flaky"),
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=0, polluters=["p"]),
         "order-dependent"),
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=0), "flaky"),  # no cause
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=1, polluters=["p"]),
         "flaky"),
        # problem 5: fails 3 of 3 alone but passed in 2 of 4 suite runs, no setter: not "fail"
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=3), "flaky"),
        # problem 8: the budget ran out before any rerun: not "flaky"
        (dict(runs=4, failures=4, isolation_runs=0, isolation_failures=0), "unverified"),
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=0, budget_cut=True),
         "unverified"),  # its search was cut short: neither flaky nor order-dependent
        # a victim found by a trial: never failed in the runs, but fails after its polluter
        (dict(runs=4, failures=0, isolation_runs=3, isolation_failures=0, polluters=["p"]),
         "order-dependent"),
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=0, concurrent=["x"]),
         "parallel-unsafe"),
        (dict(runs=4, failures=2, isolation_runs=3, isolation_failures=1, concurrent=["x"]),
         "flaky"),
        (dict(collect_error="SyntaxError"), "error"),
        # collected, but no process reached it (a stalled start-up, a crash before it): no claim
        (dict(), "unverified"),
    ],
)  # fmt: skip
def test_classification_rules(evidence: dict[str, Any], expected: str) -> None:
    assert classify(Evidence("t.py::t", **evidence)) == expected


def test_every_class_has_one_rule_and_classes_are_worst_first() -> None:
    assert sorted(c.name for c in CATALOGUE) == sorted(CLASSES)
    assert all(c.evidence for c in CATALOGUE)
    assert CLASSES[0] == "error" and CLASSES[-1] == "pass"
    assert severity("fail") < severity("flaky") < severity("pass")


def test_concurrent_tests_are_other_workers_overlapping_in_time() -> None:
    rows = (
        full("v", "failed", worker="gw0", pid=1, time=2.0)
        + full("same", worker="gw0", pid=1, index=1, time=2.5)
        + full("during", worker="gw1", pid=2, time=2.0)
        + full("later", worker="gw1", pid=2, index=1, time=9.0)
    )
    for r in rows:
        r["start"], r["stop"] = r["time"] - 0.1, r["time"] + 0.1
    every = attempts(rows)
    assert concurrent_with(every, every["run-1", "v"]) == ["during"]


def test_a_collision_during_setup_counts_as_concurrent() -> None:
    # The victim's setup ran from 1.0 to 2.0 (its row was written at 2.0) and failed there,
    # while the other worker's test ran from 1.2 to 1.5: overlap counts from the phase's own
    # start, not from when its row was written.
    victim = full("v", worker="gw0", pid=1, time=2.0)
    victim[0]["outcome"] = "failed"
    rows = victim + full("during_setup", worker="gw1", pid=2, time=1.5)
    for r in rows:
        r["start"], r["stop"] = r["time"] - 0.3, r["time"]
    victim[0]["start"] = 1.0
    every = attempts(rows)
    assert every["run-1", "v"].start == 1.0
    assert concurrent_with(every, every["run-1", "v"]) == ["during_setup"]


# ---------------------------------------------------------------- attempts


def test_any_failed_phase_fails_the_attempt() -> None:
    rows = [row("a", "setup"), row("a", "call"), row("a", "teardown", "failed", message="boom")]
    (attempt,) = attempts(rows).values()
    assert attempt.failed and attempt.message == "boom"


def test_signals_are_gathered_across_phases_and_timeout_or_crash_fail() -> None:
    rows = [row("a", "setup"), row("a", "call", signals=["capture-invalidated"]),
            row("a", "teardown", signals=["env-leak"])]  # fmt: skip
    (attempt,) = attempts(rows).values()
    assert attempt.signals == {"capture-invalidated", "env-leak"}
    assert not attempt.failed
    (crashed,) = attempts([row("b", "call", "passed", signals=["crash"])]).values()
    assert crashed.failed


def test_controller_crash_row_keeps_the_workers_position() -> None:
    rows = [row("a", "setup", index=4, pid=11, time=1.0),
            row("a", "call", "failed", index=4, pid=99, signals=["crash"], time=2.0)]  # fmt: skip
    (attempt,) = attempts(rows).values()
    assert (attempt.pid, attempt.index, attempt.failed) == (11, 4, True)
    assert "crash" in attempt.signals


def test_attempts_are_per_run() -> None:
    found = attempts(full("a", run="run-1") + full("a", "failed", run="run-2"))
    assert not found["run-1", "a"].failed and found["run-2", "a"].failed


def test_a_test_its_process_died_in_is_a_crash_or_a_stall_timeout() -> None:
    rows = [*full("done"), row("dying", "setup", index=1, time=5.0)]
    assert killed(rows) == (Killed("dying", "setup"),)
    died = attempts(rows, [RunOutcome("run-1", -9, killed=killed(rows))])
    assert (died["run-1", "dying"].failed, died["run-1", "dying"].outcome) == (True, "failed")
    assert died["run-1", "dying"].signals == {"crash"}
    assert died["run-1", "dying"].message == "the test process died while this test ran"
    assert not died["run-1", "done"].failed and "crash" not in died["run-1", "done"].signals
    stalled = attempts(rows, [RunOutcome("run-1", -9, stalled_after=30, killed=killed(rows))])
    assert stalled["run-1", "dying"].signals == {"timeout"}
    assert "30s" in stalled["run-1", "dying"].message
    assert not attempts(rows)["run-1", "dying"].failed  # its rows alone say nothing failed


def test_the_end_of_a_process_is_folded_only_into_its_own_run() -> None:
    rows = [row("t", "setup", run="run-1"), *full("t", run="run-2")]
    found = attempts(rows, [RunOutcome("run-1", -9, killed=killed(rows))])
    assert found["run-1", "t"].failed and not found["run-2", "t"].failed


def test_a_test_that_failed_before_its_process_died_keeps_its_own_message() -> None:
    rows = [row("t", "setup"), row("t", "call", "failed", message="boom", time=1.0)]
    (attempt,) = attempts(rows, [RunOutcome("run-1", 1, lost="lost", killed=killed(rows))]).values()
    assert (attempt.message, set(attempt.signals)) == ("boom", {"crash"})


def test_a_lost_replay_s_test_with_no_row_is_a_crash_where_it_stood() -> None:
    end = RunOutcome("replay-1", -9, lost="lost with node n1", gpu="3",
                     killed=(Killed("b", "", index=1, at=9.0),))  # fmt: skip
    found = attempts(full("a", run="replay-1"), [end])
    b = found["replay-1", "b"]
    assert (b.failed, set(b.signals), b.index, b.gpu, b.start) == (True, {"crash"}, 1, "3", 9.0)
    assert b.message == "lost with node n1" and b.outcome == "failed"
    assert list(found) == [("replay-1", "a"), ("replay-1", "b")]


def test_crash_already_reported_by_the_controller_is_not_doubled() -> None:
    rows = [row("a", "setup"), row("a", "call", "failed", signals=["crash"])]
    assert killed(rows) == ()


def test_process_sequence_is_the_same_process_before_the_victim() -> None:
    rows = (
        full("p1", index=0, time=1)
        + full("other", worker="gw1", pid=20, index=0, time=1.5)
        + full("p2", index=1, time=2)
        + full("v", "failed", index=2, time=3)
        + full("after", index=3, time=4)
        + full("old", index=0, pid=9, time=0.5)
    )  # an earlier, crashed worker process
    every = attempts(rows)
    victim = every["run-1", "v"]
    assert process_sequence(every, victim) == ["p1", "p2"]
    assert run_sequence(every, victim) == ["old", "p1", "other", "p2"]


# ---------------------------------------------------------------- stats


@pytest.mark.parametrize(
    ("failures", "runs", "low", "high"),
    [
        # Published values (Newcombe 1998, Table I; and the 0/10, 5/10 textbook cases).
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 10, 0.0, 0.2775),
        (5, 10, 0.2366, 0.7634),
        (1, 10, 0.0179, 0.4042),
        (10, 10, 0.7225, 1.0),
    ],
)
def test_wilson_interval_matches_published_values(
    failures: int, runs: int, low: float, high: float
) -> None:
    lo, hi = wilson_interval(failures, runs)
    assert lo == pytest.approx(low, abs=1e-4)
    assert hi == pytest.approx(high, abs=1e-4)


def test_wilson_interval_edges() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(3, 5)
    assert lo < flake_rate(3, 5) < hi
    with pytest.raises(ValueError):
        wilson_interval(4, 3)
    assert flake_rate(0, 0) == 0.0


def test_docs_class_table_is_the_catalogues() -> None:
    """docs/harness.md's class table is generated from the catalogue, and kept so."""
    docs = (Path(__file__).resolve().parents[3] / "docs" / "harness.md").read_text()
    start = docs.index("| class | example | evidence rule |")
    shown = docs[start : docs.index("\n\n", start) + 1]
    assert shown == docs_table(), "regenerate with `python -m capsafe_harness.verdicts.catalogue`"


# ---------------------------------------------------------------- capture evidence


def _neighbour_run_evidence(**capture: int) -> Evidence:
    ev = Evidence("t.py::x", runs=3, failures=2, isolation_runs=2, isolation_failures=1)
    for name, value in capture.items():
        setattr(ev.capture, name, value)
    return ev


def test_failing_only_beside_neighbours_outside_any_own_capture_is_neighbour_sensitive() -> None:
    ev = _neighbour_run_evidence(neighbor_runs=4, neighbor_failures=3, control_runs=1)
    assert classify(ev) == Verdict.NEIGHBOUR_SENSITIVE
    ev.thread_unsafe = "asserts the device pool's byte count"
    assert why(Verdict.NEIGHBOUR_SENSITIVE, ev).endswith(
        "marked thread_unsafe: asserts the device pool's byte count"
    )
    # A failure without neighbours too: not the neighbours' doing, flaky as before.
    ev.capture.control_failures = 1
    assert classify(ev) == Verdict.FLAKY


def test_capture_unsafe_needs_a_failure_inside_its_own_window() -> None:
    # Capture errors with neighbours, passing without them, but none inside its own window.
    ev = _neighbour_run_evidence(neighbor_runs=4, neighbor_failures=3, control_runs=1)
    ev.leak_failures = 3
    assert classify(ev) != Verdict.CAPTURE_UNSAFE
    ev.capture.capture_failures = 2
    ev.capture_sites = ["t.py:9"]
    assert classify(ev) == Verdict.CAPTURE_UNSAFE


def test_a_leak_victims_cause_says_its_polluter_left_a_capture_open() -> None:
    ev = Evidence("t.py::b", runs=3, failures=2, isolation_runs=3, isolation_failures=0,
                  polluters=["t.py::a"], leak_failures=2)  # fmt: skip
    assert classify(ev) == Verdict.ORDER_DEPENDENT
    assert why(Verdict.ORDER_DEPENDENT, ev).endswith("t.py::a left a capture open")
    ev.leak_failures = 0
    assert "left a capture open" not in why(Verdict.ORDER_DEPENDENT, ev)


def test_an_attempt_knows_its_captures_and_a_leak_victim() -> None:
    leaker = full("a", "failed", signals=[Signal.CAPTURE_INVALIDATED, Signal.FAILED_IN_CAPTURE])
    leaker[2] = cast(Record, {**leaker[2], "captures": [
        {"framework": "facade", "stream": "0x5", "mode": "global", "site": "t.py:4", "open": True}
    ]})  # fmt: skip
    victim = full("b", "failed", signals=[Signal.CAPTURE_INVALIDATED], index=1)
    victim[2] = cast(Record, {**victim[2], "thread_unsafe": "reads the pool"})
    found = attempts([*leaker, *victim])
    a, b = found[("run-1", "a")], found[("run-1", "b")]
    assert (a.capture_sites, a.left_open, a.leak_victim) == (("t.py:4",), ("t.py:4",), False)
    assert a.left_global_open and not b.left_global_open
    assert (b.capture_sites, b.leak_victim, b.thread_unsafe) == ((), True, "reads the pool")


def test_attempt_outcomes_say_what_the_fold_says_without_keeping_rows() -> None:
    """The report's outcome column folds outcomes row by row (no row kept); it must agree
    with the one fold, a test its process died in included."""
    from capsafe_harness.verdicts.fold import attempt_outcomes

    rows = [
        *full("t.py::test_a", "failed"),
        *full("t.py::test_b", "skipped"),
        row("t.py::test_c", "setup", "passed", run="run-2"),  # its process died in it
        *full("t.py::test_d", "xfailed", run="run-2"),
        row("t.py::test_e", "call", "weird"),  # an outcome the fold does not know
    ]
    ends = [RunOutcome("run-2", -9, killed=(Killed("t.py::test_c", "setup"),
                                              Killed("t.py::test_lost", "")))]  # fmt: skip
    folded = attempt_outcomes(rows, ends)
    expected = {key: a.outcome for key, a in attempts(rows, ends).items()}
    assert {(run, n): o for run, per in folded.items() for n, o in per.items()} == expected
    assert folded["run-2"]["t.py::test_c"] == "failed"
