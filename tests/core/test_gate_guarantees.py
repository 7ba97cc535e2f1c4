"""What docs/gate.md promises and the older tests did not hold (issue 22, item 9).

Each test kills a mutant of capsafe/gate.py that survived every other test while
being a real bug when run. Nothing here asserts a timing: latency and fairness are
checked with the gate's polling switched off (a missed wake-up then waits out a
watchdog far above any normal wait instead of 50 ms), or with a watchdog the mutant
never meets (it never gets in at all); states are observed, not slept for.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
from test_gate import JOIN_S, hold_section, join, spawn
from test_gate_regressions import CallbackCondition, gated_call_recording

from capsafe import gate as gate_module
from capsafe.errors import UsageError
from capsafe.gate import CaptureGate, CaptureGuard, GateTimeout

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


def one_section(g: CaptureGate, entered: threading.Event | None = None) -> Callable[[], None]:
    """A thread body: one shared section, marking `entered` once inside."""

    def body() -> None:
        g.enter("mem_alloc")
        if entered is not None:
            entered.set()
        g.exit()

    return body


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

    g._may_capture = CallbackCondition(g._lock, "waiter", gated_call_recording(g, outcome))
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
    section = spawn(one_section(g, entered), name="allocator")
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
    section = spawn(one_section(g, entered), name="allocator")
    until(
        lambda: entered.is_set() or g.stats().contended_waits > 0,
        "the section entering or waiting",
    )
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


def test_a_guard_is_its_own_context_and_knows_when_its_window_opened() -> None:
    g = CaptureGate()
    before = time.monotonic()
    with g.begin_capture(label="timed", timeout=JOIN_S) as guard:
        assert isinstance(guard, gate_module.CaptureGuard) and not guard.released
        assert before <= guard.started <= time.monotonic()  # the window's start
        assert guard.label == "timed" and g.owned_by_current_thread()
    assert guard.released and not g.owned_by_current_thread()


def test_sections_of_threads_that_ended_still_count_once_pruned() -> None:
    """Records of ended threads are pruned (past eight); their entries stay counted."""
    g = CaptureGate()
    for n in range(12):
        join(spawn(one_section(g), name=f"short-lived-{n}"))
    with g:
        pass
    stats = g.stats()
    assert stats.shared_entered == 13
    assert len(g._records) < 12  # pruned: the count above came from the retired total
    assert stats.holders == ()


def test_the_longest_wait_is_kept() -> None:
    began = time.monotonic()
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    waiter = spawn(one_section(g), name="waiter")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    time.sleep(0.05)  # a wait of at least this long: what max_wait_s reports
    guard.release()
    join(waiter)
    longest = g.stats().max_wait_s
    assert 0.05 <= longest <= time.monotonic() - began
    assert g.stats().shared_entered == 1  # the section that waited counts once
    join(spawn(one_section(g)))  # no wait: keeps the longest
    assert g.stats().max_wait_s == longest


def test_the_forking_thread_keeps_its_sections_as_plain_sections() -> None:
    """Forked inside its own capture, the thread keeps its sections in the child, where
    no capture of its is open: they block other captures again (not set aside)."""
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    g.enter("mem_alloc")  # inside its own window: bypassed, counted on its record
    pid = os.fork()
    if pid == 0:
        try:
            roles = [h.role for h in g.stats().holders]
            g.exit()
            g.begin_capture(timeout=1).release()
            os._exit(0 if roles == ["shared"] else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    g.exit()
    guard.release()
    assert os.waitstatus_to_exitcode(status) == 0


def test_calls_nested_in_a_section_inside_the_own_window_are_counted_as_bypassed() -> None:
    g = CaptureGate()
    with g.shared("mem_alloc"), g.begin_capture(timeout=JOIN_S), g.shared("mem_free"):
        pass
    assert g.bypassed_calls() == {"mem_free": 1}


class AfterWaitCondition(threading.Condition):
    """Runs `callback` once in `victim` when a wait returns after `ready()` holds: a
    finalizer landing in the wait after the capture it waited for has ended."""

    def __init__(self, lock: threading.RLock, victim: str, ready: Callable[[], bool],
                 callback: Callable[[], None]) -> None:  # fmt: skip
        super().__init__(lock)
        self.victim, self.ready, self.callback = victim, ready, callback
        self.ran = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        result = super().wait(timeout)
        mine = threading.current_thread().name == self.victim
        if mine and not self.ran.is_set() and self.ready():
            self.ran.set()
            self.callback()
        return result


def test_a_release_deferred_after_the_capture_ended_runs_when_the_wait_ends() -> None:
    """No capture end is coming to run it: the waiting section runs it as it enters."""
    g = CaptureGate()
    released: list[str] = []
    ran_by_then: list[list[str]] = []
    g._may_enter = AfterWaitCondition(
        g._lock,
        "waiter",
        lambda: g._owner is None,
        lambda: (
            released.append("queued") if g.defer_if_capturing(released.append, "freed") else None
        ),
    )
    guard = g.begin_capture(timeout=JOIN_S)

    def waiter() -> None:
        g.enter("mem_alloc")
        ran_by_then.append(list(released))
        g.exit()

    thread = spawn(waiter, name="waiter")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    guard.release()
    join(thread)
    assert g._may_enter.ran.is_set()
    assert ran_by_then == [["queued", "freed"]]  # deferred, then run before enter() returned


@pytest.mark.parametrize("side", ["capture", "shared"])
def test_a_wait_times_out_no_sooner_than_its_timeout(side: str) -> None:
    """Load can only make a wait longer, so this lower bound holds on any machine."""
    g = CaptureGate(shared_timeout=1.5)
    guard = g.begin_capture(timeout=JOIN_S)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            if side == "capture":
                g.begin_capture(timeout=1.5)
            else:
                g.enter("mem_alloc")
        except GateTimeout as exc:
            errors.append(exc)

    start = time.monotonic()
    join(spawn(wait, name="waiter"))
    waited = time.monotonic() - start
    guard.release()
    assert len(errors) == 1 and waited >= 1.5, (waited, errors)


def test_a_nested_call_in_an_admitted_section_whose_capture_ended_does_not_wait() -> None:
    g = CaptureGate()
    began = time.monotonic()
    guard = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    inside, ended, nested = threading.Event(), threading.Event(), threading.Event()

    def admitted() -> None:
        with g.shared("mem_alloc"):  # admitted beside the capture
            inside.set()
            assert ended.wait(JOIN_S)
            with g.shared("ctx_synchronize"):  # the capture it was admitted beside ended
                nested.set()

    thread = spawn(admitted, name="admitted")
    assert inside.wait(JOIN_S)
    guard.release()
    ended.set()
    join(thread)
    stats = g.stats()
    assert nested.is_set() and stats.admitted_measured == 1
    assert stats.contended_waits == 0  # it never waited
    assert stats.max_wait_s <= time.monotonic() - began


def test_a_parked_nested_call_reports_how_long_it_waited() -> None:
    g = CaptureGate()
    began = time.monotonic()
    guard = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    inside, nested = threading.Event(), threading.Event()

    def admitted() -> None:
        with g.shared("mem_alloc"):
            inside.set()
            with g.shared("ctx_synchronize"):  # forbidden beside the capture: parks
                nested.set()

    thread = spawn(admitted, name="admitted")
    assert inside.wait(JOIN_S)
    until(lambda: g.stats().contended_waits == 1, "the nested call parking")
    assert not nested.is_set()
    guard.release()
    join(thread)
    assert nested.is_set()
    assert 0 < g.stats().max_wait_s <= time.monotonic() - began


def test_a_release_deferred_in_a_capture_wait_waits_for_that_capture_to_end() -> None:
    """Deferred after the capture it waited for ended, the release must not run as the
    waiting thread's own capture begins: it would run inside that window."""
    g = CaptureGate()
    released: list[str] = []

    def defer_a_free() -> None:
        g.defer_if_capturing(released.append, "freed")

    g._may_capture = AfterWaitCondition(g._lock, "waiter", lambda: g._owner is None, defer_a_free)
    guard = g.begin_capture(timeout=JOIN_S)
    seen: list[list[str]] = []

    def waiter() -> None:
        with g.begin_capture(timeout=JOIN_S):
            seen.append(list(released))  # inside its own window
        seen.append(list(released))

    thread = spawn(waiter, name="waiter")
    until(lambda: g.stats().capture_waits == 1, "the capture waiting")
    guard.release()
    join(thread)
    assert g._may_capture.ran.is_set()
    assert seen == [[], ["freed"]]


def test_a_granted_section_is_named_as_such_until_it_enters() -> None:
    g = CaptureGate(fairness_s=0.001)
    roles: list[list[tuple[str, str]]] = []
    g._may_enter = AfterWaitCondition(
        g._lock,
        "section",
        lambda: record_of(g, "section").granted,
        lambda: roles.append([(h.thread_name, h.role) for h in g.holders()]),
    )
    guard = g.begin_capture(timeout=JOIN_S)
    section = spawn(one_section(g), name="section")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    time.sleep(0.01)  # longer than fairness_s: the capture's end grants it entry
    guard.release()
    join(section)
    assert roles == [[("section", "granted entry")]]


@pytest.mark.parametrize("outer", [False, True])
def test_a_signal_just_after_a_guard_is_registered_gives_it_back(outer: bool) -> None:
    """What a Ctrl-C does when it lands on the line after the registration: the
    guard never reaches the caller, so begin_capture must release it."""
    g = CaptureGate()
    first = g.begin_capture(timeout=JOIN_S) if outer else None
    where = "_begin_nested" if outer else "_begin"

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code.co_name != where:
            return tracer
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if event == "line" and "self._captures += 1" in line:
            sys.settrace(None)
            raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            g.begin_capture(timeout=JOIN_S)
    finally:
        sys.settrace(None)
    assert g.stats().open_captures == (1 if outer else 0)
    if first is not None:
        first.release()
    assert g.stats().open_captures == 0 and g.stats().holders == ()
    join(spawn(lambda: g.begin_capture(timeout=JOIN_S).release()))


def begin_here(g: CaptureGate) -> gate_module.CaptureGuard:
    return g.begin_capture(timeout=JOIN_S)  # the site the capture holder names


def test_a_capture_holder_names_where_it_began_and_owns_only_its_thread() -> None:
    g = CaptureGate()
    assert not g.owned_by_current_thread()  # no record yet, no capture
    guard = begin_here(g)
    owner_seen: list[bool] = []
    join(spawn(lambda: owner_seen.append(g.owned_by_current_thread())))
    (holder,) = g.holders()
    line = begin_here.__code__.co_firstlineno + 1
    assert holder.role == "capture" and holder.site.endswith(f":{line} in begin_here")
    assert owner_seen == [False] and g.owned_by_current_thread()
    guard.release()
    assert not g.owned_by_current_thread()


# -- wake-ups only where a thread waits ---------------------------------------------------
class CountingCondition(threading.Condition):
    """A Condition that counts its notify_all calls."""

    notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def counting(g: CaptureGate) -> tuple[CountingCondition, CountingCondition]:
    g._may_enter = CountingCondition(g._lock)
    g._may_capture = CountingCondition(g._lock)
    return g._may_enter, g._may_capture


def test_a_capture_with_nobody_waiting_wakes_nobody() -> None:
    # A free gate is taken without a wake-up, and its release wakes nobody when no thread
    # waits in the gate (each wake-up was Python calls on every protected capture).
    g = CaptureGate()
    with g:  # this thread's record (and a section set aside by the capture below)
        pass
    may_enter, may_capture = counting(g)
    g.begin_capture(timeout=JOIN_S).release()
    with g.shared("mem_alloc"):
        g.begin_capture(timeout=JOIN_S).release()  # its own section is set aside: free
    assert (may_enter.notified, may_capture.notified) == (0, 0)


def test_a_nested_begin_waiting_when_another_thread_ends_its_window_is_woken(
    no_polling: None,
) -> None:
    # The owner waits to begin a conservative nested capture (an admitted section runs);
    # another thread releases the owner's outer window: the nested begin, no longer
    # nested, must be woken by that release (it counts among the waiting captures, though
    # its record is not marked waiting), not by a poll.
    g = CaptureGate()
    admitted_in, leave, outer_taken = threading.Event(), threading.Event(), threading.Event()
    guards: list[CaptureGuard] = []

    def admitted() -> None:
        with g.shared("mem_alloc"):
            admitted_in.set()
            assert leave.wait(JOIN_S)

    def owner() -> None:
        guards.append(g.begin_capture(harmful=frozenset({"ctx_sync"}), timeout=JOIN_S))
        outer_taken.set()
        assert admitted_in.wait(JOIN_S)
        g.begin_capture(harmful=None, timeout=None).release()  # waits for the admitted one

    thread = spawn(owner, name="owner")
    assert outer_taken.wait(JOIN_S)
    holder = spawn(admitted, name="admitted")  # admitted beside the measured window
    until(lambda: g._capture_sleepers == 1, "the nested begin waiting")
    guards[0].release()  # from this thread: the owner's begin is not nested any more ...
    leave.set()  # ... and, as a fresh capture, waits for the admitted section to end
    join(holder)
    join(thread, WAKE_S)
    assert g.stats().holders == ()
