"""The gate's paths out of a wait that failed, and of a call a signal interrupted.

Each test was written for a mutant of capsafe/gate.py that the older tests let
through (tools/mutate.py): a capture that gives up waiting and leaves sections
asleep, teardown unrun or the gate reopened under another waiting capture; a
release a signal cut short that is never finished, never wakes anyone or loses its
deferred releases; a finalizer's gated call nested inside the wait it landed in; a
wrapped call's cleanup that a second signal leaves half done. Where a wake-up is at
stake, the waiter re-checks only when notified (polling every hour), so a missed
one waits out the watchdog instead of passing late.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
from test_gate import JOIN_S, hold_section, join, spawn
from test_gate_guarantees import WAKE_S, no_polling, one_section, until, waiting_captures
from test_gate_regressions import CallbackCondition, InterruptingCondition

from capsafe.errors import UsageError
from capsafe.gate import CaptureGate, GateTimeout

pytestmark = pytest.mark.timeout(60)
__all__ = ["no_polling"]  # a fixture, used by name


class CountingCondition(threading.Condition):
    """Counts each thread's waits: a waiter that waits again has looked and gone on waiting."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__(lock)
        self.waits: dict[str, int] = {}

    def wait(self, timeout: float | None = None) -> bool:
        name = threading.current_thread().name
        self.waits[name] = self.waits.get(name, 0) + 1
        return super().wait(timeout)


def raising_once(
    real: Callable[..., Any], error: type[BaseException] = KeyboardInterrupt
) -> Callable[..., Any]:
    """`real`, except that its first call raises `error` before doing anything: a signal
    landing at that call."""
    fired: list[bool] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            raise error
        return real(*args, **kwargs)

    return call


def refused(outcome: list[BaseException | None]) -> bool:
    return len(outcome) == 1 and isinstance(outcome[0], UsageError)


# -- a capture that gives up waiting -------------------------------------------------------
def test_a_capture_that_gives_up_lets_waiting_sections_in_and_runs_queued_teardown() -> None:
    """Sections re-check every fairness_s (here an hour): the capture giving up must wake
    them, and teardown queued behind it runs then (no window is coming to run it)."""
    g = CaptureGate(fairness_s=3600.0)
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    armed = threading.Event()
    g._may_capture = InterruptingCondition(g._lock, "capturer", armed)
    ran: list[str] = []
    ran_when_it_raised: list[list[str]] = []

    def capturer() -> None:
        with pytest.raises(KeyboardInterrupt):
            g.begin_capture(timeout=JOIN_S)
        ran_when_it_raised.append(list(ran))

    capture_thread = spawn(capturer, name="capturer")
    until(lambda: waiting_captures(g) == 1, "the capture waiting")
    section_entered = threading.Event()
    section = spawn(one_section(g, section_entered), name="section")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    assert g.defer_while_closed(ran.append, "destroyed")
    armed.set()
    join(capture_thread)
    join(section, timeout=WAKE_S)  # woken by the capture giving up, not by a poll
    leave.set()
    join(holder)
    assert ran_when_it_raised == [["destroyed"]]
    assert section_entered.is_set() and g.stats().holders == ()


def test_a_capture_that_gives_up_keeps_the_gate_closed_for_another_waiting_capture() -> None:
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    armed = threading.Event()
    g._may_capture = InterruptingCondition(g._lock, "first", armed)
    ran: list[str] = []
    seen_in_window: list[list[str]] = []

    def first() -> None:
        with pytest.raises(KeyboardInterrupt):
            g.begin_capture(timeout=JOIN_S)

    def second() -> None:
        with g.begin_capture(timeout=JOIN_S):
            seen_in_window.append(list(ran))

    first_thread = spawn(first, name="first")
    until(lambda: waiting_captures(g) == 1, "the first capture waiting")
    second_thread = spawn(second, name="second")
    until(lambda: waiting_captures(g) == 2, "both captures waiting")
    assert g.defer_while_closed(ran.append, "destroyed")
    armed.set()
    join(first_thread)
    assert ran == []  # queued behind the second capture, which still waits
    section_entered = threading.Event()
    section = spawn(one_section(g, section_entered), name="section")
    until(
        lambda: section_entered.is_set() or g.stats().contended_waits == 1,
        "the section entering or waiting",
    )
    assert not section_entered.is_set(), "a section entered while a capture waits"
    leave.set()
    join(holder)
    join(second_thread)
    join(section)
    assert seen_in_window == [[]] and ran == ["destroyed"]


def test_a_release_deferred_in_a_capture_wait_that_failed_runs_when_it_fails() -> None:
    """No capture is open or coming when the wait fails: the release runs then."""
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    released: list[str] = []
    queued: list[bool] = []

    def finalizer_then_signal() -> None:
        queued.append(g.defer_if_capturing(released.append, "freed"))
        raise KeyboardInterrupt

    g._may_capture = CallbackCondition(g._lock, "capturer", finalizer_then_signal)
    seen: list[list[str]] = []

    def capturer() -> None:
        with pytest.raises(KeyboardInterrupt):
            g.begin_capture(timeout=JOIN_S)
        seen.append(list(released))

    join(spawn(capturer, name="capturer"))
    leave.set()
    join(holder)
    assert queued == [True] and seen == [["freed"]]


def test_a_capture_wait_that_raises_with_the_lock_let_go_leaves_a_usable_gate() -> None:
    """Condition.wait can raise after letting the lock go (a signal between the two):
    the gate's code after it must still find the lock held."""
    g = CaptureGate()

    class LockLosingCondition(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            if threading.current_thread().name == "capturer":
                self._release_save()  # type: ignore[attr-defined]
                raise KeyboardInterrupt
            return super().wait(timeout)

    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    g._may_capture = LockLosingCondition(g._lock)
    raised: list[BaseException] = []

    def capturer() -> None:
        try:
            g.begin_capture(timeout=JOIN_S)
        except BaseException as exc:
            raised.append(exc)

    join(spawn(capturer, name="capturer"))
    leave.set()
    join(holder)
    assert len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt), raised
    assert g.stats().holders == ()
    join(spawn(lambda: g.begin_capture(timeout=JOIN_S).release(), name="next"))


def test_a_nested_capture_that_fails_to_drain_narrows_the_set_back() -> None:
    """Under the measured policy a nested capture widens the set before it drains the
    admitted sections; when the drain fails, what the outer capture allows runs again."""
    g = CaptureGate()
    armed = threading.Event()
    g._may_capture = InterruptingCondition(g._lock, threading.current_thread().name, armed)
    outer = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    inside, leave = threading.Event(), threading.Event()

    def admitted() -> None:
        with g.shared("mem_alloc"):
            inside.set()
            assert leave.wait(JOIN_S)

    holder = spawn(admitted, name="admitted")
    assert inside.wait(JOIN_S)
    armed.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            g.begin_capture(harmful=None, timeout=JOIN_S)  # drains the admitted section
        entered = threading.Event()
        section = spawn(one_section(g, entered), name="allocator")
        until(
            lambda: entered.is_set() or g.stats().contended_waits > 0,
            "the section entering or waiting",
        )
        assert entered.is_set(), "kept out by a nested capture that never began"
        join(section)
    finally:
        leave.set()
        outer.release()
    join(holder)
    assert g.stats().open_captures == 0


# -- a release that a signal cut short -----------------------------------------------------
@pytest.mark.parametrize("where", ["_release", "_wake_waiting_sections"])
def test_an_interrupted_release_is_finished_wakes_sections_and_runs_deferred_releases(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A signal at the release's entry, or midway (at its first call after the state
    change): the guard's release() finishes it, wakes the section waiting for the
    window's end (it re-checks only every hour) and runs the releases deferred in the
    window, then raises the signal's exception."""
    g = CaptureGate(fairness_s=3600.0)
    guard = g.begin_capture(timeout=JOIN_S)
    released: list[str] = []
    assert g.defer_if_capturing(released.append, "freed")  # a finalizer in the window
    entered = threading.Event()
    section = spawn(one_section(g, entered), name="section")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    monkeypatch.setattr(g, where, raising_once(getattr(g, where)))
    with pytest.raises(KeyboardInterrupt):
        guard.release()
    assert guard.released and g.stats().open_captures == 0
    assert released == ["freed"]
    join(section, timeout=WAKE_S)
    assert entered.is_set()
    assert guard.release() is False
    g.begin_capture(timeout=JOIN_S).release()


def test_an_interrupted_release_wakes_the_capture_waiting_for_it(
    monkeypatch: pytest.MonkeyPatch, no_polling: None
) -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    capturer = spawn(lambda: g.begin_capture(timeout=None).release(), name="capturer")
    until(lambda: g.stats().capture_waits == 1, "the capture waiting")
    monkeypatch.setattr(g, "_wake_waiting_sections", raising_once(g._wake_waiting_sections))
    with pytest.raises(KeyboardInterrupt):
        guard.release()
    join(capturer, timeout=WAKE_S)  # woken by the finished release, not by a poll


# -- a gated call whose slow path was interrupted ------------------------------------------
@pytest.mark.parametrize("interrupted", [True, False])
def test_a_section_that_steps_back_out_wakes_the_capture_it_blocked(
    monkeypatch: pytest.MonkeyPatch, no_polling: None, interrupted: bool
) -> None:
    """A section publishes its depth, then sees the gate closed and takes the slow path;
    a capture that looked meanwhile waits for it. Stepping back out (to wait, or because
    a signal landed there) must wake that capture: nothing else will."""
    g = CaptureGate()
    waits = CountingCondition(g._lock)
    g._may_capture = waits
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    capturer = spawn(lambda: g.begin_capture(timeout=None).release(), name="capturer")
    until(lambda: waits.waits.get("capturer", 0) == 1, "the capture waiting")
    inside, go = threading.Event(), threading.Event()
    real = CaptureGate._enter_slow

    def held_back(self: CaptureGate, rec: Any, call: str | None) -> None:
        if threading.current_thread().name == "late":
            inside.set()  # its depth is published: the capture counts it
            assert go.wait(JOIN_S)
            if interrupted:
                raise KeyboardInterrupt
        real(self, rec, call)

    monkeypatch.setattr(CaptureGate, "_enter_slow", held_back)

    def late() -> None:
        if interrupted:
            with pytest.raises(KeyboardInterrupt):
                g.enter("mem_alloc")
        else:
            one_section(g)()

    late_thread = spawn(late, name="late")
    assert inside.wait(JOIN_S)
    leave.set()
    join(holder)
    until(lambda: waits.waits["capturer"] == 2, "the capture looking again and waiting on")
    go.set()
    join(capturer, timeout=WAKE_S)
    join(late_thread)
    assert g.stats().holders == ()


class HeldNotifications(CountingCondition):
    """Notifications held back until `let_go()` (the section sleeps through the capture's
    end); then `victim`'s wait raises KeyboardInterrupt once, as a signal there would."""

    def __init__(self, lock: threading.RLock, victim: str) -> None:
        super().__init__(lock)
        self.victim, self.holding, self.fired = victim, True, False

    def notify_all(self) -> None:
        if not self.holding:
            super().notify_all()

    def let_go(self) -> None:  # with the lock held
        self.holding = False
        super().notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        result = super().wait(timeout)
        mine = threading.current_thread().name == self.victim
        if mine and not self.holding and not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return result


def test_a_section_giving_back_its_grant_wakes_the_capture_waiting_on_it(
    monkeypatch: pytest.MonkeyPatch, no_polling: None
) -> None:
    """A section granted entry ahead of the next capture is interrupted before it uses
    the grant, and a second signal lands at the wake-up in enter()'s own cleanup: the
    wait's cleanup must already have woken the capture that waits on the grant."""
    g = CaptureGate(fairness_s=3600.0)
    first = g.begin_capture(timeout=JOIN_S)
    sections, captures = HeldNotifications(g._lock, "section"), CountingCondition(g._lock)
    g._may_enter, g._may_capture = sections, captures

    def section() -> None:
        with pytest.raises(Second) as raised:
            g.enter("mem_alloc")
        assert isinstance(raised.value.__context__, KeyboardInterrupt)

    section_thread = spawn(section, name="section")
    until(lambda: sections.waits.get("section", 0) == 1, "the section waiting an hour")
    capturer = spawn(lambda: g.begin_capture(timeout=None).release(), name="capturer")
    until(lambda: captures.waits.get("capturer", 0) == 1, "the capture waiting")
    g.fairness_s = 0.0  # at this capture's end the section is old enough for a grant
    first.release()  # grants the section (its wake-up held back) and wakes the capture
    until(lambda: captures.waits["capturer"] == 2, "the capture waiting on the grant")
    monkeypatch.setattr(g, "_wake", raising_once(g._wake, Second))
    with g._lock:
        sections.let_go()
    join(section_thread)
    join(capturer, timeout=WAKE_S)  # woken by the returned grant, not by a poll
    assert g.stats().holders == ()


def test_a_fork_from_a_finalizer_in_a_wait_leaves_the_child_free_to_capture() -> None:
    """The forking thread keeps its record in the child, where it waits for nothing."""
    g = CaptureGate()
    statuses: list[int] = []

    def fork_here() -> None:
        pid = os.fork()
        if pid == 0:
            code = 4
            try:
                g.begin_capture(timeout=JOIN_S).release()
                with g:
                    code = 0
            finally:
                os._exit(code)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

    g._may_enter = CallbackCondition(g._lock, "waiter", fork_here)
    guard = g.begin_capture(timeout=JOIN_S)
    waiter = spawn(one_section(g), name="waiter")
    assert g._may_enter.ran.wait(JOIN_S)
    until(lambda: len(statuses) == 1, "the child's exit")
    guard.release()
    join(waiter)
    assert statuses == [0]


# -- finalizers landing in a wait ----------------------------------------------------------
def recording(
    g: CaptureGate, outcome: list[BaseException | None], action: Callable[[], None]
) -> Callable[[], None]:
    """A finalizer running `action`: records the UsageError that refuses it, or None."""

    def finalizer() -> None:
        try:
            action()
        except UsageError as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    return finalizer


def test_a_finalizer_in_a_sections_wait_is_refused() -> None:
    g = CaptureGate()
    outcome: list[BaseException | None] = []

    def gated_call() -> None:
        with g.shared("mem_alloc"):
            pass

    g._may_enter = CallbackCondition(g._lock, "waiter", recording(g, outcome, gated_call))
    guard = g.begin_capture(timeout=JOIN_S)
    waiter = spawn(one_section(g), name="waiter")
    assert g._may_enter.ran.wait(JOIN_S)
    guard.release()
    join(waiter)
    assert refused(outcome), outcome
    assert g.stats().shared_entered == 1 and g.stats().holders == ()


def test_a_finalizer_beginning_a_capture_in_a_sections_wait_is_refused() -> None:
    g = CaptureGate()
    outcome: list[BaseException | None] = []

    def capture() -> None:
        g.begin_capture(timeout=JOIN_S).release()

    g._may_enter = CallbackCondition(g._lock, "waiter", recording(g, outcome, capture))
    guard = g.begin_capture(timeout=JOIN_S)
    waiter = spawn(one_section(g), name="waiter")
    assert g._may_enter.ran.wait(JOIN_S)
    guard.release()
    join(waiter)
    assert refused(outcome), outcome
    assert "begin_capture" in str(outcome[0])
    assert g.stats().captures == 1


def test_a_finalizer_in_a_parked_nested_call_is_refused() -> None:
    """A section admitted beside a measured capture parks a nested call the capture
    forbids; a finalizer's forbidden call landing in that park must not park again."""
    g = CaptureGate()
    outcome: list[BaseException | None] = []

    def forbidden_call() -> None:
        with g.shared("ctx_synchronize"):
            pass

    g._may_enter = CallbackCondition(g._lock, "admitted", recording(g, outcome, forbidden_call))
    guard = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)

    def admitted() -> None:
        with g.shared("mem_alloc"), g.shared("ctx_synchronize"):  # the nested call parks
            pass

    thread = spawn(admitted, name="admitted")
    assert g._may_enter.ran.wait(JOIN_S)
    guard.release()
    join(thread)
    assert refused(outcome), outcome
    assert g.stats().holders == ()


# -- timeouts ------------------------------------------------------------------------------
def test_a_parked_nested_call_times_out_no_sooner_than_its_timeout() -> None:
    """Load can only make the wait longer, so the lower bound holds on any machine."""
    g = CaptureGate(shared_timeout=1.0)
    guard = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    waited: list[tuple[float, GateTimeout]] = []

    def admitted() -> None:
        with g.shared("mem_alloc"):  # admitted beside the capture
            start = time.monotonic()
            try:
                with g.shared("ctx_synchronize"):  # parks: the capture forbids it
                    pass
            except GateTimeout as exc:
                waited.append((time.monotonic() - start, exc))

    thread = spawn(admitted, name="admitted")
    try:
        join(thread)
    finally:
        guard.release()
    assert len(waited) == 1, waited
    seconds, error = waited[0]
    assert seconds >= 1.0, seconds
    assert "ctx_synchronize on thread 'admitted' could not enter within 1 s" in str(error)
    assert g.stats().holders == ()


# -- fairness ------------------------------------------------------------------------------
def test_a_section_younger_than_fairness_waits_behind_the_next_capture() -> None:
    """Only a section that has waited fairness_s goes ahead of the next capture. (The
    fairness here is long, but shorter than the clock has run: a section that never
    noted when it began waiting would look that old.)"""
    g = CaptureGate(fairness_s=min(3600.0, time.monotonic() / 2))
    first = g.begin_capture(timeout=JOIN_S)
    entered = threading.Event()
    section = spawn(one_section(g, entered), name="section")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    seen: list[bool] = []

    def second() -> None:
        with g.begin_capture(timeout=JOIN_S):
            seen.append(entered.is_set())
            g.fairness_s = 0.0  # at this capture's end the section is old enough

    capturer = spawn(second, name="second")
    until(lambda: waiting_captures(g) == 1, "the second capture waiting")
    first.release()
    join(capturer)
    join(section)
    assert seen == [False], "a young section went ahead of the waiting capture"


# -- fork ----------------------------------------------------------------------------------
def stale_release_changes_nothing(g: CaptureGate, stale: Any) -> bool:
    """In a forked child: a capture waits behind a section with teardown queued behind
    it; releasing the parent's guard must neither run that teardown nor open anything."""
    ran: list[str] = []
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    seen: list[list[str]] = []

    def capture() -> None:
        with g.begin_capture(timeout=JOIN_S):
            seen.append(list(ran))

    capturer = spawn(capture, name="capturer")
    until(lambda: waiting_captures(g) == 1, "the child's capture waiting")
    assert g.defer_while_closed(ran.append, "destroyed")
    stale_result = stale.release()
    untouched = ran == []
    leave.set()
    join(holder)
    join(capturer)
    return stale_result is True and untouched and seen == [[]] and ran == ["destroyed"]


def test_releasing_a_guard_taken_before_fork_changes_nothing_in_the_child() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            code = 0 if stale_release_changes_nothing(g, guard) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert guard.release() is True


# -- a wrapped call's cleanup, interrupted -------------------------------------------------
class First(BaseException):
    """The first signal."""


class Second(BaseException):
    """A second signal, landing while the first one's cleanup runs."""


class AfterEnter:
    """A tracer raising `First` in the wrapped call just after `enter()` returns into it,
    where CPython delivers a signal (the tracer is gone once it raised)."""

    def __init__(self) -> None:
        self.enter_code = CaptureGate.enter.__code__
        self.entered = self.fired = False

    def on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is self.enter_code:
            return self.on_enter
        if frame.f_code.co_name == "section":
            frame.f_trace_opcodes = True
            return self.in_section
        return None

    def on_enter(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self.entered = True
        return self.on_enter

    def in_section(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and self.entered:
            self.fired = True
            raise First
        return self.in_section


@pytest.mark.parametrize(
    ("first", "second"),
    [(True, False), (True, True), (False, True)],
    ids=["after-enter", "after-enter-then-exit", "exit"],
)
def test_a_signal_in_a_wrapped_call_closes_the_section_and_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch, first: bool, second: bool
) -> None:
    """A signal just after `enter()` returned (the call is not made), at `exit()`'s entry,
    or both (the second landing in the first one's cleanup): the section is closed all
    the same, and the latest signal's exception reaches the caller (with the first as
    its context)."""
    g = CaptureGate()
    if second:
        monkeypatch.setattr(g, "exit", raising_once(g.exit, Second))  # before wrap() binds it
    ran: list[str] = []
    call = g.wrap(lambda: ran.append("call"), "mem_alloc")
    tracer = AfterEnter()
    if first:
        # On CPython 3.12 opcode events reach a frame only if some frame asked for them
        # before settrace (python/cpython#114480): this one does.
        sys._getframe().f_trace_opcodes = True
        sys.settrace(tracer.on_call)
    try:
        with pytest.raises(Second if second else First) as raised:
            call()
    finally:
        sys.settrace(None)
    assert tracer.fired == first
    assert ran == ([] if first else ["call"])
    if second:
        assert isinstance(raised.value.__context__, First) == first
    assert g._tls.rec.depth == 0
    assert g.stats().holders == ()
    join(spawn(lambda: g.begin_capture(timeout=JOIN_S).release(), name="next"))


# -- a signal in the release's last steps ------------------------------------------------


@pytest.mark.parametrize("at", ["_may_enter", "_may_capture"])
def test_a_signal_at_a_release_wake_up_loses_no_deferred_release(at: str) -> None:
    # A finalizer's release deferred in this thread's capture must run once the release
    # is over, even when a signal lands at one of the release's wake-ups (before, the
    # deferred list was taken off the gate before the last wake-up, and lost with it).
    gate = CaptureGate()
    ran: list[int] = []
    guard = gate.begin_capture()
    assert gate.defer_if_capturing(ran.append, 1)
    # A release wakes only where a thread waits: a section (here granted at once), or a
    # capture.
    if at == "_may_enter":

        def section() -> None:
            with gate:
                pass

        waiter = spawn(section, name="section")
        _until(lambda: any(r.waiting for r in gate._records))
        gate._wake_waiting_sections = lambda: True  # type: ignore[method-assign]
    else:
        waiter = spawn(lambda: gate.begin_capture(timeout=JOIN_S).release(), name="capture")
        _until(lambda: gate._capture_sleepers == 1)
    condition = getattr(gate, at)
    condition.notify_all = raising_once(condition.notify_all)
    with pytest.raises(KeyboardInterrupt):
        guard.release()
    join(waiter)
    assert ran == [1]
    assert not gate.holders() and gate.owned_by_current_thread() is False
    with gate.shared("mem_alloc"):  # usable afterwards
        pass


def _until(condition: Callable[[], object]) -> None:
    """Poll until `condition()` holds (a thread reached a wait), or fail after JOIN_S."""
    deadline = time.monotonic() + JOIN_S
    while not condition():
        assert time.monotonic() < deadline, "the waiter never reached its wait"
        time.sleep(0.001)


def test_a_signal_in_one_deferred_release_keeps_the_rest_queued() -> None:
    gate = CaptureGate()
    ran: list[str] = []

    def interrupted() -> None:
        ran.append("interrupted")
        raise KeyboardInterrupt

    guard = gate.begin_capture()
    assert gate.defer_if_capturing(interrupted)
    assert gate.defer_if_capturing(ran.append, "after")
    with pytest.raises(KeyboardInterrupt):
        guard.release()
    assert ran == ["interrupted", "after"]  # the one after it still ran, once
    with gate.begin_capture():
        pass
    assert ran == ["interrupted", "after"]
