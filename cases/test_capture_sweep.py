"""The capture phases' evidence rule, batched reruns and attribution, with a fake sweep host."""

from __future__ import annotations

import time

from capsafe_harness import phase_times
from capsafe_harness.capture_sweep import CaptureEvidence, CapturePhases, neighbor_args
from capsafe_harness.classify import Attempt

BREAKS = {"cap": {"ctx_sync", "memset_sync"}}  # what breaks each capture-unsafe test


def attempt(nodeid: str, failed: bool, capture: bool = False, run: str = "r") -> Attempt:
    signals = frozenset({"capture-invalidated"} if capture else ())
    return Attempt(nodeid, run, failed, signals, "main", 1, 0, 0.0, None, "")


class FakeHost:
    """Runs batches as the neighbours would break them: `cap` fails with a capture error
    under any kind in BREAKS, `always` fails every time, `plain` passes."""

    def __init__(self) -> None:
        self.batches: list[tuple[tuple[str, ...], bool, tuple[str, ...]]] = []

    def batch(self, tests, *, neighbors, calls, seed, kind):
        self.batches.append((tuple(tests), neighbors, tuple(calls)))
        out = {}
        for t in tests:
            kinds = set(calls) if calls else {"ctx_sync", "mem_alloc", "memset_sync"}
            broke = neighbors and bool(kinds & BREAKS.get(t, set()))
            failed = broke or t == "always"
            out[(kind, t)] = attempt(t, failed, capture=broke or t == "always", run=kind)
        return out

    def pool(self, desc, jobs, work):
        queue = list(jobs)
        while queue:
            queue += work(queue.pop(0), 0)


def phases_after_suite_runs() -> CapturePhases:
    phases = CapturePhases(2, ["mem_alloc", "ctx_sync", "memset_sync"])
    for nodeid, capture in (("cap", True), ("always", True), ("plain", False)):
        phases.saw(attempt(nodeid, True, capture), neighbors=True)
    return phases


def test_the_evidence_rule():
    ev = CaptureEvidence(neighbor_runs=2, capture_failures=1, batch_control_passes=1)
    assert ev.capture_unsafe
    ev.batch_control_failures = 1  # a failed batched control: only alone reruns decide now
    assert not ev.capture_unsafe
    ev.control_runs = 1
    assert ev.capture_unsafe
    ev.control_failures = 1
    assert not ev.capture_unsafe
    assert not CaptureEvidence(neighbor_runs=3, capture_failures=3).capture_unsafe  # no control


def test_capture_failures_are_rerun_batched_and_the_rest_alone():
    phases, host = phases_after_suite_runs(), FakeHost()
    alone = phases.isolate(host, ["always", "cap", "plain"], 3, [1, 2, 3], seed=5)
    # One process per rerun for both suspects; without, with, without neighbours.
    batches = [(tests, n) for tests, n, calls in host.batches if not calls]
    assert batches == [(("always", "cap"), False), (("always", "cap"), True),
                       (("always", "cap"), False)]  # fmt: skip
    assert phases.capture_unsafe("cap") and not phases.capture_unsafe("always")
    assert alone == ["always", "plain"]  # its batched control failed: ordinary reruns decide


def test_alone_reruns_alternate_and_count():
    phases = phases_after_suite_runs()
    assert phases.alone_args() == [("--capsafe-neighbors=0",), ()]
    assert CapturePhases(0).alone_args() == [()]
    phases.saw_alone("always", True, {"capture-invalidated"}, 0)  # rerun 0: the control
    assert not phases.capture_unsafe("always")
    assert neighbor_args(True, ["ctx_sync", "mem_alloc"]) == (
        "--capsafe-neighbor-calls=ctx_sync,mem_alloc",
    )


def test_attribution_names_the_breaking_kinds_and_the_report_fields():
    phases, host = phases_after_suite_runs(), FakeHost()
    phases.isolate(host, ["always", "cap"], 2, [1, 2], seed=5)
    assert set(phases.attributions) == {"cap"}  # only capture-unsafe tests are reported
    found = phases.attributions["cap"]
    # The groups (mem_alloc | ctx_sync | memset_sync here: one kind each) ran once for both.
    assert phases.attribution_processes == 3
    assert (found.breaks, found.survives) == (["ctx_sync", "memset_sync"], ["mem_alloc"])
    fields = phases.test_fields("cap", "cd s && pytest t.py")
    assert fields["replay"].endswith("--capsafe-neighbor-calls=ctx_sync,memset_sync")
    assert fields["verdict"].startswith("breaks under: ctx_sync, memset_sync; survives")
    assert "passed 1 of 1 without them" in phases.why("cap")


def test_phase_times_sum_processes_and_phases(tmp_path):
    now = time.time()
    marks = [{"started": now, "configured": now + 1, "collected": now + 3, "cuda_ready": now + 4,
              "finished": now + 10}]  # fmt: skip
    rows = [{"phase": "call", "duration": 2.0}, {"phase": "setup", "duration": 0.5}]
    got = phase_times.process_phase_seconds(marks, rows)
    assert (got["pytest_start"], got["collection"], got["neighbors_cuda_init"]) == (1, 2, 1)
    assert got["call"] == 2.0 and got["other"] == 3.5
    clock = phase_times.SweepClock()
    with clock.phase("runs"):
        pass
    assert set(clock.seconds) == {"runs"}
    started = phase_times.process_start_time()
    assert started is None or now - 3600 * 24 < started <= now


def test_a_capture_error_seen_only_alone_still_gets_its_breaking_calls():
    """Seen on the H200 (CuPy's test_capture_run_on_same_stream[False]): the suite-run
    failure was not a capture error, the alone rerun with neighbours was; the test was
    capture-unsafe with every call kind undecided."""
    BREAKS["late"] = {"ctx_sync"}
    try:
        phases, host = CapturePhases(2, ["mem_alloc", "ctx_sync", "memset_sync"]), FakeHost()
        phases.saw(attempt("late", True, capture=False), neighbors=True)
        assert phases.isolate(host, ["late"], 2, [1, 2], seed=5) == ["late"]  # not a suspect
        phases.saw_alone("late", False, set(), 0)  # the control passes
        phases.saw_alone("late", True, {"capture-invalidated"}, 1)  # with neighbours: breaks
        assert phases.capture_unsafe("late") and "late" not in phases.attributions
        phases.attribute_late(host, ["late"], seed=5)
        assert phases.attributions["late"].breaks == ["ctx_sync"]
        processes = len(host.batches)
        phases.attribute_late(host, ["late"], seed=5)  # attributed once only
        assert len(host.batches) == processes
    finally:
        del BREAKS["late"]
