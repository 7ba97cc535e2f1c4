"""The capture phases' evidence rule, batched reruns and attribution, with a fake sweep host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from serial_host import SerialHost

from capsafe.integrations import NAMES
from capsafe.integrations.observe import POINTS
from capsafe_harness.plugin import phase_times
from capsafe_harness.plugin.protect import FRAMEWORKS
from capsafe_harness.records import Signal
from capsafe_harness.sweep import capture_sweep
from capsafe_harness.sweep.capture_sweep import CapturePhases, neighbor_args, protect_choice
from capsafe_harness.sweep.host import Replayed
from capsafe_harness.sweep.options import SweepError
from capsafe_harness.verdicts.evidence import CaptureEvidence
from capsafe_harness.verdicts.fold import Attempt

BREAKS = {"cap": {"ctx_sync", "memset_sync"}}  # what breaks each capture-unsafe test
UNPROTECTABLE = {"bypass"}  # tests that still break with --capsafe-protect
BATCH_ONLY = {"flaky_in_batch"}  # tests that break with protection only beside other tests


IN_WINDOW = frozenset({Signal.CAPTURE_INVALIDATED, Signal.FAILED_IN_CAPTURE})
"""A capture error raised inside the test's own window, as the plugin records it."""


def attempt(nodeid: str, failed: bool, capture: bool = False, run: str = "r") -> Attempt:
    signals = IN_WINDOW if capture else frozenset()
    return Attempt(nodeid, run, failed, signals, "main", 1, 0, 0.0, None, "",
                   capture_sites=("t.py:7",) if capture else ())  # fmt: skip


class FakeHost(SerialHost):
    """Runs batches as the neighbours would break them: `cap` fails with a capture error
    under any kind in BREAKS, `always` fails every time, `plain` passes. With protection,
    only UNPROTECTABLE tests break (and BATCH_ONLY ones beside other tests)."""

    def __init__(self, installed: tuple[str, ...] = ("cupy",)) -> None:
        self.batches: list[tuple[tuple[str, ...], bool, tuple[str, ...]]] = []
        self.protected: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        self.installed = installed
        super().__init__()

    def frameworks(self) -> tuple[str, ...]:
        return self.installed

    def replay(
        self, sequence: Sequence[str], *, seed: int | None, kind: str,
        extra: Sequence[str] = (), exclusive: bool = False, group: object = None,
    ) -> Replayed:  # fmt: skip
        """What a test process would make of the options the capture phases give it."""
        options = dict(arg.split("=", 1) for arg in extra)
        found = self.batch(
            sequence, neighbors=options.get("--capsafe-neighbors") != "0",
            calls=[c for c in options.get("--capsafe-neighbor-calls", "").split(",") if c],
            seed=seed, kind=kind,
            protect=[p for p in options.get("--capsafe-protect", "").split(",") if p],
        )  # fmt: skip
        return Replayed(kind, {a.nodeid: a for a in found.values()}, 0, bool(found), Path("log"))

    def batch(
        self, tests: Sequence[str], *, neighbors: bool, calls: Sequence[str], seed: int | None,
        kind: str, protect: Sequence[str] = (),
    ) -> dict[tuple[str, str], Attempt]:  # fmt: skip
        if protect:
            self.protected.append((tuple(tests), tuple(protect)))
        else:
            self.batches.append((tuple(tests), neighbors, tuple(calls)))
        out: dict[tuple[str, str], Attempt] = {}
        for t in tests:
            kinds = set(calls) if calls else {"ctx_sync", "mem_alloc", "memset_sync"}
            broke = neighbors and bool(kinds & BREAKS.get(t, set()))
            if protect:
                broke = t in UNPROTECTABLE or (t in BATCH_ONLY and len(tests) > 1)
            failed = broke or t == "always"
            out[(kind, t)] = attempt(t, failed, capture=broke or t == "always", run=kind)
        return out


def phases_after_suite_runs() -> CapturePhases:
    phases = CapturePhases(2, ["mem_alloc", "ctx_sync", "memset_sync"])
    for nodeid, capture in (("cap", True), ("always", True), ("plain", False)):
        phases.saw(attempt(nodeid, True, capture), neighbors=True)
    return phases


def test_the_evidence_rule() -> None:
    ev = CaptureEvidence(neighbor_runs=2, capture_failures=1, batch_control_passes=1)
    assert ev.capture_unsafe
    ev.batch_control_failures = 1  # a failed batched control: only alone reruns decide now
    assert not ev.capture_unsafe
    ev.control_runs = 1
    assert ev.capture_unsafe
    ev.control_failures = 1
    assert not ev.capture_unsafe
    assert not CaptureEvidence(neighbor_runs=3, capture_failures=3).capture_unsafe  # no control


def test_capture_failures_are_rerun_batched_and_the_rest_alone() -> None:
    phases, host = phases_after_suite_runs(), FakeHost()
    alone = phases.isolate(host, ["always", "cap", "plain"], 3, [1, 2, 3], seed=5)
    # One process per rerun for both suspects; without, with, without neighbours.
    batches = [(tests, n) for tests, n, calls in host.batches if not calls]
    assert batches == [(("always", "cap"), False), (("always", "cap"), True),
                       (("always", "cap"), False)]  # fmt: skip
    assert phases.capture_unsafe("cap") and not phases.capture_unsafe("always")
    assert alone == ["always", "plain"]  # its batched control failed: ordinary reruns decide


def test_a_capture_error_outside_its_own_windows_is_no_capture_suspect() -> None:
    # A leak victim: a capture error, no capture of its own. A library error inside its own
    # window: no capture error by name, a capture failure all the same.
    phases, host = CapturePhases(2, ["ctx_sync"]), FakeHost()
    victim = Attempt("victim", "r", True, frozenset({Signal.CAPTURE_INVALIDATED}), "main", 1, 0,
                     0.0, None, "")  # fmt: skip
    library = Attempt("library", "r", True, frozenset({Signal.FAILED_IN_CAPTURE}), "main", 1,
                      0, 0.0, None, "", capture_sites=("t.py:3",))  # fmt: skip
    phases.saw(victim, neighbors=True)
    phases.saw(library, neighbors=True)
    assert phases.store["victim"].leak_victim and not phases.store["library"].leak_victim
    assert phases.store["library"].capture_sites == ["t.py:3"]
    alone = phases.isolate(host, ["library", "victim"], 1, [1], seed=5)
    assert alone == ["victim"]  # to the alone reruns and the polluter search
    assert all("victim" not in tests for tests, _, _ in host.batches)  # no rerun, no attribution
    assert phases.capture_unsafe("library")
    assert "captured at t.py:3" in phases.why("library")


def test_alone_reruns_alternate_and_count() -> None:
    phases = phases_after_suite_runs()
    assert phases.alone_args() == [("--capsafe-neighbors=0",), ()]
    assert CapturePhases(0).alone_args() == [()]
    phases.saw_alone("always", True, IN_WINDOW, 0)  # rerun 0: the control
    assert not phases.capture_unsafe("always")
    assert neighbor_args(True, ["ctx_sync", "mem_alloc"]) == (
        "--capsafe-neighbor-calls=ctx_sync,mem_alloc",
    )


def test_attribution_names_the_breaking_kinds_and_the_report_fields() -> None:
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


def test_phase_times_sum_processes_and_phases(tmp_path: Path) -> None:
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


@pytest.mark.skipif(not Path("/proc/uptime").exists(), reason="needs Linux /proc")
def test_a_process_start_time_is_read_to_the_clock_tick() -> None:
    """The boot time in /proc/stat is whole seconds: read with it, a process's start came
    up to a second early, and the H200 sweeps showed every forked child taking 0.8 s to
    start. A child's start now lies between the clock readings around its spawn, within
    one clock tick (and the reading's own hundredths)."""
    code = "from capsafe_harness.plugin import phase_times; print(phase_times.process_start_time())"
    before = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    after = time.time()
    tick = 1 / os.sysconf("SC_CLK_TCK") + 0.01
    assert before - tick <= float(done.stdout) <= after + tick


def test_a_capture_error_seen_only_alone_still_gets_its_breaking_calls() -> None:
    """Seen on the H200 (CuPy's test_capture_run_on_same_stream[False]): the suite-run
    failure was not a capture error, the alone rerun with neighbours was; the test was
    capture-unsafe with every call kind undecided."""
    BREAKS["late"] = {"ctx_sync"}
    try:
        phases, host = CapturePhases(2, ["mem_alloc", "ctx_sync", "memset_sync"]), FakeHost()
        phases.saw(attempt("late", True, capture=False), neighbors=True)
        assert phases.isolate(host, ["late"], 2, [1, 2], seed=5) == ["late"]  # not a suspect
        phases.saw_alone("late", False, set(), 0)  # the control passes
        phases.saw_alone("late", True, IN_WINDOW, 1)  # with neighbours: breaks
        assert phases.capture_unsafe("late") and "late" not in phases.attributions
        phases.attribute_late(host, ["late"], seed=5)
        assert phases.attributions["late"].breaks == ["ctx_sync"]
        processes = len(host.batches)
        phases.attribute_late(host, ["late"], seed=5)  # attributed once only
        assert len(host.batches) == processes
    finally:
        del BREAKS["late"]


@pytest.fixture
def three_unsafe() -> Iterator[tuple[CapturePhases, FakeHost]]:
    """Phases after isolation with three capture-unsafe tests: one the integration protects,
    one whose capture bypasses every hook, one that breaks protected only beside others."""
    BREAKS.update({"bypass": {"ctx_sync"}, "flaky_in_batch": {"ctx_sync"}})
    try:
        phases, host = CapturePhases(2, ["mem_alloc", "ctx_sync", "memset_sync"]), FakeHost()
        for nodeid in ("bypass", "cap", "flaky_in_batch"):
            phases.saw(attempt(nodeid, True, capture=True), neighbors=True)
        phases.isolate(host, ["bypass", "cap", "flaky_in_batch"], 2, [1, 2], seed=5)
        yield phases, host
    finally:
        del BREAKS["bypass"], BREAKS["flaky_in_batch"]


def test_capture_unsafe_tests_are_rerun_protected_batched_then_alone(
    three_unsafe: tuple[CapturePhases, FakeHost],
) -> None:
    phases, host = three_unsafe
    phases.protect(host, "cupy", 2, [1, 2], frameworks=host.frameworks)
    everyone = ("bypass", "cap", "flaky_in_batch")
    assert (
        host.protected
        == [(everyone, ("cupy",))] * 2
        + [(("bypass",), ("cupy",))] * 2
        + [(("flaky_in_batch",), ("cupy",))] * 2
    )  # the tests a batch failed get alone reruns, and those decide
    fields = {t: phases.test_fields(t, "pytest t.py") for t in everyone}
    assert [fields[t]["survived"] for t in everyone] == [False, True, True]
    assert (fields["bypass"]["protected_runs"], fields["bypass"]["protected_failures"]) == (2, 2)
    assert fields["cap"]["protect"] == ["cupy"]
    assert fields["cap"]["protection"] == "with protection: survived 2/2 (cupy)"
    assert fields["bypass"]["protection"] == (
        "still fails 2/2 with protection (cupy): not protectable by capsafe "
        "(see docs/integrations.md, hazard rows: always (ctx_sync))"
    )
    assert "; with protection: survived 2/2 (cupy); breaks under: ctx_sync" in phases.why("cap")


def test_protect_none_does_no_protected_reruns(
    three_unsafe: tuple[CapturePhases, FakeHost],
) -> None:
    phases, host = three_unsafe
    phases.protect(host, "none", 2, [1, 2], frameworks=host.frameworks)
    assert host.protected == []
    fields = phases.test_fields("cap", "pytest t.py")
    assert (fields["survived"], fields["protected_runs"]) == (None, 0)
    assert fields["protection"] == "with protection: not rerun (--protect none)"


def test_auto_without_a_framework_gives_no_verdict(
    three_unsafe: tuple[CapturePhases, FakeHost],
) -> None:
    phases, _ = three_unsafe
    host = FakeHost(installed=())
    phases.protect(host, "auto", 2, [1, 2], frameworks=host.frameworks)
    assert host.protected == []
    fields = phases.test_fields("bypass", "pytest t.py")
    assert (fields["survived"], fields["protect"]) == (None, [])
    assert fields["protection"].startswith("with protection: no capsafe integration applies")
    auto = FakeHost(installed=("cuda_core",))
    phases.protect(auto, "auto", 1, [1], frameworks=auto.frameworks)
    assert {p for _, p in auto.protected} == {("cuda_core",)}


def test_auto_protects_with_what_the_captures_went_through(
    three_unsafe: tuple[CapturePhases, FakeHost],
) -> None:
    """`--protect auto` takes the integrations of the frameworks the capture-unsafe tests
    captured through; the interpreter's other frameworks are not installed (a CuPy suite's
    protected reruns imported torch on the H200: 1.8-4.3 s each)."""
    phases, _ = three_unsafe
    for nodeid in ("bypass", "cap", "flaky_in_batch"):
        phases.saw(replace(attempt(nodeid, True, capture=True), capture_frameworks=("cupy",)),
                   neighbors=True)  # fmt: skip
    host = FakeHost(installed=("cupy", "torch"))
    phases.protect(host, "auto", 1, [1], frameworks=host.frameworks)
    assert {p for _, p in host.protected} == {("cupy",)}
    assert phases.test_fields("cap", "pytest t.py")["protect"] == ["cupy"]


def test_the_observers_framework_names_are_the_integrations() -> None:
    """What `auto` reads: the observer's hook point names, one per integration."""
    points = {p.name for p in POINTS}
    assert set(FRAMEWORKS) <= points


def test_a_sweep_stopped_before_its_protected_reruns_says_so() -> None:
    phases, host = phases_after_suite_runs(), FakeHost()
    phases.isolate(host, ["cap"], 2, [1, 2], seed=5)
    fields = phases.test_fields("cap", "pytest t.py")
    assert fields["survived"] is None and "stopped before its protected reruns" in fields[
        "protection"]  # fmt: skip


def test_the_protect_option_values() -> None:
    assert set(FRAMEWORKS) == set(NAMES)  # every integration has its framework to look for
    assert protect_choice(" auto") == "auto" and protect_choice("none") == "none"
    assert protect_choice("cupy, cuda_core,cupy") == "cupy,cuda_core"
    for bad in ("tensorflow", "cupy,jax", ","):
        with pytest.raises(SweepError, match=r"^--protect: unknown integration"):
            protect_choice(bad)


def test_protected_reruns_that_run_no_test_give_no_verdict(
    three_unsafe: tuple[CapturePhases, FakeHost],
) -> None:
    phases, _ = three_unsafe

    class CannotInstall(FakeHost):  # every protected process stops at a usage error
        def batch(
            self, tests: Sequence[str], *, protect: Sequence[str] = (), **kwargs: Any
        ) -> dict[tuple[str, str], Attempt]:
            return {} if protect else super().batch(tests, protect=protect, **kwargs)

    cannot = CannotInstall()
    phases.protect(cannot, "cupy", 2, [1, 2], frameworks=cannot.frameworks)
    assert cannot.notes and "the protected rerun ran no test" in cannot.notes[0]
    fields = phases.test_fields("cap", "pytest t.py")
    assert (fields["survived"], fields["protected_runs"]) == (None, 0)
    assert fields["protection"] == (
        "with protection (cupy): the protected reruns did not run it (see the notes)"
    )


class ScriptedHost(FakeHost):
    """Answers every replay with the attempts a script gives for its sequence."""

    def __init__(self, answer: Callable[[Sequence[str]], list[Attempt]]) -> None:
        super().__init__()
        self.answer = answer
        self.sequences: list[tuple[str, ...]] = []

    def replay(
        self, sequence: Sequence[str], *, seed: int | None, kind: str,
        extra: Sequence[str] = (), exclusive: bool = False, group: object = None,
    ) -> Replayed:  # fmt: skip
        self.sequences.append(tuple(sequence))
        return Replayed(kind, {a.nodeid: a for a in self.answer(sequence)}, 0, True, Path("log"))


def test_an_attribution_process_runs_each_test_several_times() -> None:
    # A short capture window: one try per kind per round missed it on the H200.
    host = ScriptedHost(lambda seq: [attempt(n, False) for n in dict.fromkeys(seq)])
    outcomes = capture_sweep.attribute(cast(Any, host), ["ctx_sync"], ["a", "b"], seed=1)
    reps = capture_sweep.ATTRIBUTION_REPEATS
    assert host.sequences == [("a",) * reps + ("b",) * reps]
    assert outcomes == {"a": False, "b": False}


def test_each_later_attribution_round_runs_the_unbroken_tests_twice_as_often() -> None:
    # A window no single kind hit in a round is tried again with twice the tries (the H200:
    # test_stream_fork_join[True] named `ctx_sync` in one sweep, no kind in the next).
    class LuckyLate(FakeHost):
        def batch(self, tests: Sequence[str], **kwargs: Any) -> dict[tuple[str, str], Attempt]:
            found = super().batch(tests, **kwargs)
            if kwargs["kind"] == "attrib" and len(tests) < 4 * capture_sweep.ATTRIBUTION_REPEATS:
                return {key: replace(a, failed=False, signals=frozenset())
                        for key, a in found.items()}  # fmt: skip
            return found

    phases, host = CapturePhases(2, ["ctx_sync"]), LuckyLate()
    phases.saw(attempt("cap", True, capture=True), neighbors=True)
    phases.isolate(host, ["cap"], 2, [1, 2], seed=5)
    tries = [len(tests) for tests, neighbors, calls in host.batches if calls == ("ctx_sync",)]
    reps = capture_sweep.ATTRIBUTION_REPEATS
    assert tries == [reps, 2 * reps, 4 * reps]
    assert phases.attributions["cap"].breaks == ["ctx_sync"]  # only the third round hit it


@pytest.mark.parametrize("global_mode", [True, False])
def test_a_break_after_another_test_left_a_global_capture_open_is_no_evidence(
    global_mode: bool,
) -> None:
    # A GLOBAL capture left open fails every later capture's allocations; one of another
    # mode lets new captures on other streams begin and end (the H200's left-open rows).
    def answer(seq: Sequence[str]) -> list[Attempt]:
        leaker = Attempt("a", "r", True, IN_WINDOW, "main", 1, 0, 0.0, None, "",
                         capture_sites=("t.py:7",), left_open=("t.py:7",),
                         left_global_open=global_mode)  # fmt: skip
        after = Attempt("b", "r", True, IN_WINDOW, "main", 1, 3, 0.0, None, "",
                        capture_sites=("t.py:9",))  # fmt: skip
        return [after, leaker]

    outcomes = capture_sweep.attribute(cast(Any, ScriptedHost(answer)), ["ctx_sync"],
                                       ["a", "b"], seed=1)  # fmt: skip
    assert outcomes == {"a": True, "b": None if global_mode else True}
