"""What docs/gate.md promises and the older tests did not hold (issue 22, item 9).

Each test kills a mutant of capsafe/gate.py that survived every other test while
being a real bug when run. Nothing here asserts a timing: latency and fairness are
checked with the gate's polling switched off (a missed wake-up then waits out a
watchdog far above any normal wait instead of 50 ms), or with a watchdog the mutant
never meets (it never gets in at all); states are observed, not slept for.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
from test_gate import JOIN_S, hold_section, join, spawn
from test_gate_regressions import CallbackCondition

from capsafe import gate as gate_module
from capsafe.errors import UsageError
from capsafe.gate import CaptureGate

pytestmark = pytest.mark.timeout(60)
#: What a capture woken by a notification has to enter within; it normally takes
#: well under a millisecond, and without the wake-up it waits for the watchdog.
WAKE_S = min(5.0, JOIN_S)


def until(condition: Callable[[], bool], what: str, timeout: float = JOIN_S) -> None:
    """Wait for a state (never for a time); fail naming it if it never comes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.001)


def record_of(g: CaptureGate, name: str) -> gate_module._Record:
    found = [r for r in g._records if r.thread_name == name]
    assert len(found) == 1, [r.thread_name for r in g._records]
    return found[0]


def waiting_captures(g: CaptureGate) -> int:
    return sum(h.role == "waiting capture" for h in g.stats().holders)


@pytest.fixture
def no_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting capture re-checks only when notified (polling every hour)."""
    monkeypatch.setattr(gate_module, "_POLL_S", 3600.0)


# -- (a) a finalizer's gated call never runs beside another thread's capture ----------------
def test_a_finalizer_in_a_capture_wait_with_a_section_open_is_refused() -> None:
    """The waiting thread holds a section of its own, set aside so it blocks no capture:
    a finalizer's gated call nested in it would run beside whatever capture begins."""
    g = CaptureGate()
    outcome: list[BaseException | None] = []

    def finalizer() -> None:
        try:
            g.enter("mem_alloc")
        except UsageError as exc:
            outcome.append(exc)
        else:
            outcome.append(None)
            g.exit()

    g._may_capture = CallbackCondition(g._lock, "waiter", finalizer)
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)

    def waiter() -> None:
        with g.shared("mem_alloc"):  # its own section: the capture below sets it aside
            g.begin_capture(timeout=JOIN_S).release()  # waits for the holder

    thread = spawn(waiter, name="waiter")
    assert g._may_capture.ran.wait(JOIN_S)
    leave.set()
    join(holder)
    join(thread)
    assert len(outcome) == 1 and isinstance(outcome[0], UsageError), outcome
    assert "finalizer" in str(outcome[0])
    assert g.stats().holders == ()


# -- (b) wake-ups: a waiting capture enters when what it waits for ends --------------------
# The waiting capture has no timeout and polling is off: only the notification wakes
# it, and the join's watchdog (WAKE_S) fails the test when it never comes.
def test_a_capture_waiting_for_a_section_is_woken_when_it_ends(no_polling: None) -> None:
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    capturer = spawn(lambda: g.begin_capture(timeout=None).release(), name="capturer")
    until(lambda: g.stats().capture_waits == 1, "the capture waiting")
    leave.set()
    join(holder)
    join(capturer, timeout=WAKE_S)


def test_a_capture_waiting_for_a_capture_is_woken_when_it_ends(no_polling: None) -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    capturer = spawn(lambda: g.begin_capture(timeout=None).release(), name="capturer")
    until(lambda: g.stats().capture_waits == 1, "the capture waiting")
    guard.release()
    join(capturer, timeout=WAKE_S)


def test_a_capture_waiting_for_an_admitted_section_is_woken_when_it_ends(
    no_polling: None,
) -> None:
    g = CaptureGate()
    opened, entered, leave = threading.Event(), threading.Event(), threading.Event()

    def owner() -> None:
        with g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S):
            opened.set()
            assert entered.wait(JOIN_S)
            # a nested capture that every call breaks drains the admitted section
            g.begin_capture(harmful=None, timeout=None).release()

    def admitted() -> None:
        assert opened.wait(JOIN_S)
        with g.shared("mem_alloc"):  # admitted beside the measured capture
            entered.set()
            assert leave.wait(JOIN_S)

    owner_thread = spawn(owner, name="owner")
    holder = spawn(admitted, name="admitted")
    until(lambda: g.stats().capture_waits == 1, "the nested capture draining")
    assert g.stats().admitted_measured == 1
    leave.set()
    join(holder)
    join(owner_thread, timeout=WAKE_S)
    assert g.stats().holders == ()


# -- (c) writer preference: a capture gets in under busy allocator threads -----------------
def test_captures_get_in_under_four_busy_allocator_threads() -> None:
    """Each allocator holds its section across a sleep, so at almost every instant one
    of them is inside. A capture gets in only because it stops new sections while it
    waits, and a capture waiting behind another one keeps them stopped when that one
    ends. Each capture normally enters within milliseconds; without writer
    preference it never does (GateTimeout at the watchdog)."""
    g = CaptureGate()
    stop = threading.Event()

    def allocator() -> None:
        while not stop.is_set():
            with g.shared("mem_alloc"):
                time.sleep(0.0005)

    allocators = [spawn(allocator, name=f"allocator-{n}") for n in range(4)]
    try:
        until(lambda: g.stats().shared_entered >= 8, "the allocators running")
        for _ in range(5):
            first = g.begin_capture(timeout=JOIN_S)  # gets in under the allocators
            second = spawn(lambda: g.begin_capture(timeout=JOIN_S).release(), name="second")
            until(lambda: waiting_captures(g) == 1, "the second capture waiting")
            assert first.release() is True
            join(second)  # got in after the first, under the allocators
    finally:
        stop.set()
        for thread in allocators:
            join(thread)
    assert g.stats().captures == 10
    assert g.stats().holders == ()


def test_release_says_whether_it_released() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    inner = g.begin_capture(timeout=JOIN_S)
    assert inner.release() is True and not guard.released
    assert guard.release() is True and guard.released
    assert guard.release() is False and inner.release() is False
    assert g.stats().open_captures == 0


# -- (d) the measured policy admits nothing while a capture waits --------------------------
def test_measured_policy_admits_no_section_while_another_capture_waits() -> None:
    g = CaptureGate()
    guard = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    waiting = spawn(lambda: g.begin_capture(harmful=None, timeout=JOIN_S).release(), "second")
    until(lambda: waiting_captures(g) == 1, "the second capture waiting")
    entered = threading.Event()
    section = spawn(lambda: (g.enter("mem_alloc"), entered.set(), g.exit()), name="allocator")
    until(
        lambda: entered.is_set() or g.stats().contended_waits == 1,
        "the section entering or waiting",
    )
    assert not entered.is_set(), "admitted beside the open capture while another waits"
    assert g.stats().admitted_measured == 0
    guard.release()
    join(waiting)
    join(section)
    assert entered.is_set()


def test_a_waiting_section_is_admitted_when_a_measured_capture_begins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sections re-check every fairness_s (here an hour): the capture that begins must
    wake the ones its set lets in."""
    g = CaptureGate(fairness_s=3600.0)
    guard = g.begin_capture(timeout=JOIN_S)  # conservative: the section waits
    entered, leave = threading.Event(), threading.Event()

    def section() -> None:
        with g.shared("mem_alloc"):
            entered.set()
            assert leave.wait(JOIN_S)

    allocator = spawn(section, name="allocator")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    measured: list[object] = []

    def measured_capture() -> None:
        with g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S):
            measured.append(entered.wait(WAKE_S))  # admitted while this capture is open
            leave.set()

    capturer = spawn(measured_capture, name="measured")
    until(lambda: waiting_captures(g) == 1, "the measured capture waiting")
    guard.release()
    join(capturer)
    join(allocator)
    assert measured == [True]
    assert g.stats().admitted_measured == 1


# -- (e) a signal landing as a gated call takes the slow path leaves no section -----------
@pytest.mark.parametrize("where", ["_enter_slow", "_wait_to_enter"])
def test_an_exception_in_the_slow_path_of_enter_leaves_no_section(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """What a Ctrl-C or pytest-timeout's signal does when it lands at a call of the slow
    path: the section published on the fast path must be taken back. The victim's
    thread stays alive (a thread that has exited blocks no capture)."""
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    real = getattr(CaptureGate, where)

    def interrupted(self: CaptureGate, *args: object) -> None:
        if threading.current_thread().name == "victim":
            raise KeyboardInterrupt
        real(self, *args)

    monkeypatch.setattr(CaptureGate, where, interrupted)
    raised, done = threading.Event(), threading.Event()

    def victim() -> None:
        with pytest.raises(KeyboardInterrupt):
            g.enter("mem_alloc")
        raised.set()
        assert done.wait(JOIN_S)

    thread = spawn(victim, name="victim")
    assert raised.wait(JOIN_S)
    monkeypatch.undo()
    guard.release()
    try:
        assert g.stats().holders == ()
        g.begin_capture(timeout=WAKE_S).release()  # a leaked section: GateTimeout
    finally:
        done.set()
    join(thread)


def test_releasing_a_nested_capture_narrows_the_set_back_to_the_outer_one() -> None:
    """Under the measured policy a nested capture that every call breaks widens the set;
    once it ends, what the outer capture allows runs beside it again."""
    g = CaptureGate()
    outer = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    g.begin_capture(harmful=None, timeout=JOIN_S).release()
    entered = threading.Event()
    section = spawn(lambda: (g.enter("mem_alloc"), entered.set(), g.exit()), name="allocator")
    until(lambda: entered.is_set() or g.stats().contended_waits, "the section entering or waiting")
    assert entered.is_set(), "kept out by a nested capture that had ended"
    join(section)
    assert g.stats().admitted_measured == 1
    outer.release()


def test_a_guard_taken_before_fork_releases_nothing_in_the_child() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    pid = os.fork()
    if pid == 0:  # the child's gate is fresh: the guard is released, and only once
        try:
            ok = guard.release() is True and guard.released and guard.release() is False
            g.begin_capture(timeout=1).release()
            os._exit(0 if ok and g.stats().open_captures == 0 else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not guard.released and g.stats().open_captures == 1  # the parent's is intact
    assert guard.release() is True
