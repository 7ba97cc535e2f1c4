"""The gate's bookkeeping, held to what it promises: counters, holders, queued teardown, pruning.

Each test here was written for a mutant of capsafe/gate.py that the older tests let
through (tools/mutate.py): a counter never bumped or bumped the wrong way, a holder
listed in the wrong role or at the wrong site, teardown run inside a window that is
still open, records of ended threads kept for ever, a lock on the uncontended path.
States are waited for, never slept for; the only sleeps give a wait a lower bound.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from test_gate import JOIN_S, hold_section, join, spawn
from test_gate_guarantees import one_section, until, waiting_captures

from capsafe import gate as gate_module
from capsafe.gate import CaptureGate, GateTimeout

pytestmark = pytest.mark.timeout(60)


def running_in(thread: threading.Thread, function: str) -> bool:
    """Whether `function` is on `thread`'s live stack (where it blocks, for one)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


# -- the uncontended path takes no lock ----------------------------------------------------
def test_uncontended_and_nested_sections_take_no_lock() -> None:
    """The module docstring's promise: with no capture about, a section (outermost or
    nested) costs attribute stores, never the gate's lock. Held by another thread, the
    lock would stall any section that took it."""
    g = CaptureGate()
    warmed, go, done = threading.Event(), threading.Event(), threading.Event()

    def sections() -> None:
        with g:  # the first section of a thread registers its record (under the lock)
            pass
        warmed.set()
        assert go.wait(JOIN_S)
        with g, g.shared("mem_alloc"), g:
            pass
        done.set()

    thread = spawn(sections, name="sections")
    assert warmed.wait(JOIN_S)
    with g._lock:
        go.set()
        finished = done.wait(JOIN_S)
    join(thread)
    assert finished, "a section without any capture about waited for the gate's lock"
    assert g.stats().shared_entered == 2


def test_a_section_whose_capture_ended_before_it_looked_again_does_not_count_a_wait() -> None:
    """A section that saw the gate closed takes the lock; the capture ends before it
    gets it: it enters at once, and no contended wait is counted."""
    g = CaptureGate()
    warmed, go, entered = threading.Event(), threading.Event(), threading.Event()

    def late() -> None:
        with g:
            pass
        warmed.set()
        assert go.wait(JOIN_S)
        one_section(g, entered)()

    thread = spawn(late, name="late")
    assert warmed.wait(JOIN_S)
    guard = g.begin_capture(timeout=JOIN_S)
    with g._lock:  # the section's slow path blocks on it, after it saw the gate closed
        go.set()
        until(lambda: running_in(thread, "_enter_slow"), "the section in its slow path")
        guard.release()  # the lock is re-entrant: the capture ends while it waits for it
    join(thread)
    stats = g.stats()
    assert entered.is_set() and stats.shared_entered == 2
    assert stats.contended_waits == 0 and stats.max_wait_s == 0.0


# -- counters -------------------------------------------------------------------------------
def test_sections_a_capturing_thread_enters_in_its_own_window_are_counted_as_bypassed() -> None:
    g = CaptureGate()
    with g.shared("mem_alloc"), g.begin_capture(timeout=JOIN_S):
        with g.shared("mem_free"):  # nested in a section set aside by the capture
            pass
        with g.shared("mem_free"):
            pass
    with g.begin_capture(timeout=JOIN_S), g.shared("mem_alloc"):  # outermost, in the window
        pass
    assert g.stats().bypassed == 3
    assert g.bypassed_calls() == {"mem_free": 2, "mem_alloc": 1}


@pytest.mark.parametrize("nested", [False, True])
def test_the_longest_capture_wait_is_kept(nested: bool) -> None:
    """A capture waits for a section (nested under the measured policy: for a section
    admitted beside its outer capture to drain); that wait is what max_wait_s reports."""
    began = time.monotonic()
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()

    def section() -> None:
        with g.shared("mem_alloc"):  # admitted beside a measured capture
            entered.set()
            assert leave.wait(JOIN_S)

    def leave_after_a_wait() -> None:
        until(lambda: g.stats().capture_waits == 1, "the capture waiting")
        time.sleep(0.05)  # a wait of at least this long: what max_wait_s reports
        leave.set()

    outer = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    if not nested:
        outer.release()
    holder = spawn(section, name="holder")
    assert entered.wait(JOIN_S)
    leaver = spawn(leave_after_a_wait, name="leaver")
    if nested:
        g.begin_capture(harmful=None, timeout=JOIN_S).release()  # drains the holder
        outer.release()
    else:
        join(spawn(lambda: g.begin_capture(timeout=JOIN_S).release(), name="capturer"))
    join(leaver)
    join(holder)
    stats = g.stats()
    assert stats.capture_waits == 1
    assert 0.05 <= stats.max_wait_s <= time.monotonic() - began


# -- holders --------------------------------------------------------------------------------
def test_a_section_waiting_for_a_capture_is_no_holder() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    section = spawn(one_section(g), name="waiting-section")
    until(lambda: g.stats().contended_waits == 1, "the section waiting")
    assert [(h.thread_name, h.role) for h in g.holders()] == [
        (threading.current_thread().name, "capture")
    ]
    guard.release()
    join(section)


def wait_to_capture(g: CaptureGate) -> None:
    g.begin_capture(timeout=JOIN_S).release()  # the site its holder entry names


def test_each_holder_is_named_at_its_own_site() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    capturer = spawn(lambda: wait_to_capture(g), name="second")
    until(lambda: waiting_captures(g) == 1, "the second capture waiting")
    sites = {h.role: h.site for h in g.holders()}
    guard.release()
    join(capturer)
    assert sites["capture"].endswith(" in test_each_holder_is_named_at_its_own_site"), sites
    assert sites["waiting capture"].endswith(" in wait_to_capture"), sites


def test_a_capture_timeout_names_the_holders_but_not_the_waiting_capture_itself() -> None:
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    try:
        with pytest.raises(GateTimeout) as raised:
            g.begin_capture(label="late", timeout=0.2)
    finally:
        leave.set()
        join(holder)
    message = str(raised.value)
    assert "thread 'holder' (shared, 1 section" in message, message
    assert "waiting capture" not in message and message.count("thread '") == 1, message


# -- teardown queued behind a capture (defer_while_closed) --------------------------------
def test_teardown_with_no_capture_about_is_not_queued() -> None:
    g = CaptureGate()
    ran: list[str] = []
    assert g.defer_while_closed(ran.append, "destroyed") is False  # the caller runs it
    g.begin_capture(timeout=JOIN_S).release()
    assert ran == [] and g.stats().deferred == 0


def test_teardown_is_queued_behind_an_open_capture_and_runs_once_at_its_end() -> None:
    g = CaptureGate()
    ran: list[str] = []
    guard = g.begin_capture(timeout=JOIN_S)
    queued: list[bool] = []
    join(spawn(lambda: queued.append(g.defer_while_closed(ran.append, "destroyed"))))
    assert queued == [True] and ran == []
    assert g.stats().deferred == 1
    guard.release()
    assert ran == ["destroyed"]
    g.begin_capture(timeout=JOIN_S).release()
    assert ran == ["destroyed"] and g.stats().deferred == 1


def test_teardown_waits_for_the_outer_capture_not_a_nested_one() -> None:
    """A nested capture's end is inside the outer window: the outer capture is still
    being recorded, and a graph executable's destroy there would break it."""
    g = CaptureGate()
    ran: list[str] = []
    outer = g.begin_capture(timeout=JOIN_S)
    inner = g.begin_capture(timeout=JOIN_S)
    join(spawn(lambda: g.defer_while_closed(ran.append, "destroyed")))
    inner.release()
    assert ran == []
    outer.release()
    assert ran == ["destroyed"]


# -- records of ended threads ---------------------------------------------------------------
def test_records_of_ended_threads_are_pruned_as_new_threads_come() -> None:
    """Without anyone calling stats(): a process that starts threads for ever must not
    keep a record for each (every capture scans them all)."""
    g = CaptureGate()
    stop = threading.Event()

    def long_lived() -> None:
        with g:
            pass
        assert stop.wait(JOIN_S)

    keep = [spawn(long_lived, name=f"long-lived-{n}") for n in range(8)]
    try:
        until(lambda: len(g._records) == 8, "the long-lived threads registered")
        for n in range(12):
            join(spawn(one_section(g), name=f"short-lived-{n}"))
        assert len(g._records) <= 9, [r.thread_name for r in g._records]
    finally:
        stop.set()
        for thread in keep:
            join(thread)
    assert g.stats().shared_entered == 20


def test_a_reset_between_tests_replaces_the_process_gate_and_leaves_others_alone() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=JOIN_S)
    before = gate_module.gate()
    gate_module._reset(False)
    assert gate_module.gate() is not before
    assert g.stats().open_captures == 1 and not guard.released  # not a fork: kept
    assert guard.release() is True and g.stats().open_captures == 0


# -- found by a wider sample of mutants ----------------------------------------------------
def test_a_nested_capture_drains_admitted_sections_only_not_idle_threads() -> None:
    """Another thread that has used the gate and now holds nothing (alive, depth 0)
    runs no driver call beside the capture: a nested capture does not wait for it."""
    g = CaptureGate()
    used, stop = threading.Event(), threading.Event()

    def idle() -> None:
        with g:
            pass
        used.set()
        assert stop.wait(JOIN_S)

    thread = spawn(idle, name="idle")
    assert used.wait(JOIN_S)
    try:
        with g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S):
            g.begin_capture(harmful=None, timeout=JOIN_S).release()
    finally:
        stop.set()
        join(thread)
    assert g.stats().capture_waits == 0


def test_a_release_deferred_in_a_window_waits_for_its_end_when_another_section_enters() -> None:
    """A section admitted beside the capture passes the gate's slow path, which runs the
    releases deferred while no capture is open or coming; one is open: not yet."""
    g = CaptureGate()
    released: list[str] = []
    guard = g.begin_capture(harmful=frozenset({"ctx_synchronize"}), timeout=JOIN_S)
    assert g.defer_if_capturing(released.append, "freed")  # a finalizer in the window
    entered = threading.Event()
    join(spawn(one_section(g, entered), name="admitted"))
    assert entered.is_set() and g.stats().admitted_measured == 1
    assert released == []
    guard.release()
    assert released == ["freed"]
