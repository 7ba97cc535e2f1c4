"""The capture gate's load-bearing details, one test each, on plain threads (no driver)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from capsafe.errors import UsageError
from capsafe.gate import CaptureGate, GateTimeout, gate

pytestmark = pytest.mark.timeout(30)
#: The watchdog of every wait in these tests: far above any normal wait. tools/mutate.py
#: lowers it (CAPSAFE_TEST_WATCHDOG_S) so a mutant that hangs is judged sooner.
JOIN_S = float(os.environ.get("CAPSAFE_TEST_WATCHDOG_S", "10"))


class Spawned(threading.Thread):
    """A thread that keeps what it raised, for `join` to raise again."""

    errors: list[BaseException]


def spawn(fn: Callable[[], object], name: str = "gate-test") -> Spawned:
    """Start `fn` on a daemon thread; any exception is re-raised by `join`."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = Spawned(target=body, name=name, daemon=True)
    thread.errors = errors
    thread.start()
    return thread


def join(thread: Spawned, timeout: float = JOIN_S) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"{thread.name} still blocked after {timeout} s (deadlock?)"
    if thread.errors:
        raise thread.errors[0]


def blocked(thread: threading.Thread, for_s: float = 0.1) -> bool:
    thread.join(for_s)
    return thread.is_alive()


def wait_for(condition: Callable[[], object]) -> None:
    """Poll until `condition()` holds: a state reached, not a sleep that hopes for it (a
    loaded machine starts threads late). One never reached hangs into the watchdog."""
    while not condition():
        time.sleep(0.001)


def hold_section(g: CaptureGate, entered: threading.Event, leave: threading.Event) -> None:
    with g:
        entered.set()
        assert leave.wait(JOIN_S)


def test_shared_sections_nest_and_count_outermost_entries() -> None:
    g = CaptureGate()
    with g, g.shared("mem_alloc"), g:
        pass
    with g:
        pass
    assert g.stats().shared_entered == 2
    assert g.stats().holders == ()


def test_exit_without_enter_is_a_usage_error() -> None:
    g = CaptureGate()
    with g:
        pass
    with pytest.raises(UsageError):
        g.exit()


def test_capture_waits_for_a_shared_section_already_running() -> None:
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave))
    assert entered.wait(JOIN_S)
    got = threading.Event()

    def capturer_steps() -> None:
        g.begin_capture(timeout=JOIN_S).release()
        got.set()

    capturer = spawn(capturer_steps)
    wait_for(lambda: g._closed)  # the capture is now waiting (not merely slow to start)
    assert blocked(capturer)
    assert not got.is_set()
    leave.set()
    join(holder)
    join(capturer)
    assert got.is_set()
    assert g.stats().capture_waits == 1


def test_capturing_thread_bypasses_its_own_gate() -> None:
    g = CaptureGate()
    with g.begin_capture(timeout=1):
        with g.shared("mem_alloc"):  # would deadlock without the bypass
            pass
        assert g.owned_by_current_thread()
    stats = g.stats()
    assert stats.bypassed == 1
    assert g.bypassed_calls() == {"mem_alloc": 1}


def test_open_capture_blocks_new_sections_on_other_threads() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=1)

    def other_steps() -> None:
        g.enter()
        g.exit()

    other = spawn(other_steps)
    assert blocked(other)
    guard.release()
    join(other)
    assert g.stats().contended_waits == 1


def test_waiting_capture_blocks_new_sections_writer_preference() -> None:
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), "holder")
    assert entered.wait(JOIN_S)
    captured = threading.Event()

    def capturer_steps() -> None:
        g.begin_capture(timeout=JOIN_S).release()
        captured.set()

    capturer = spawn(capturer_steps)
    while not g._closed:  # the capture is now waiting
        time.sleep(0.001)
    late = threading.Event()

    def reader_steps() -> None:
        g.enter()
        late.set()
        g.exit()

    reader = spawn(reader_steps, "late-reader")
    assert blocked(reader), "a new section got past a waiting capture"
    leave.set()
    join(holder)
    join(capturer)
    join(reader)
    assert captured.is_set() and late.is_set()


def test_nested_section_enters_while_a_capture_waits() -> None:
    g = CaptureGate()
    entered, nest, nested = threading.Event(), threading.Event(), threading.Event()

    def nesting() -> None:
        with g:
            entered.set()
            assert nest.wait(JOIN_S)
            with g:  # re-entry must not wait for the waiting capture
                nested.set()

    holder = spawn(nesting)
    assert entered.wait(JOIN_S)
    capturer = spawn(lambda: g.begin_capture(timeout=JOIN_S).release())
    while not g._closed:
        time.sleep(0.001)
    nest.set()
    assert nested.wait(JOIN_S), "a nested section deadlocked on a waiting capture"
    join(holder)
    join(capturer)


def test_two_threads_in_sections_both_beginning_a_capture_do_not_deadlock() -> None:
    g = CaptureGate()
    both_in = threading.Barrier(2, timeout=JOIN_S)
    done: list[str] = []

    def section_then_capture(name: str) -> None:
        with g:
            both_in.wait()
            with g.begin_capture(timeout=5):
                done.append(name)

    t1, t2 = (
        spawn(lambda: section_then_capture("a"), "a"),
        spawn(lambda: section_then_capture("b"), "b"),
    )
    join(t1)
    join(t2)
    assert sorted(done) == ["a", "b"]


def test_guard_released_from_another_thread_opens_the_gate() -> None:
    g = CaptureGate()
    guard = g.begin_capture(timeout=1)

    def reader_steps() -> None:
        g.enter()
        g.exit()

    reader = spawn(reader_steps)
    assert blocked(reader)
    releaser = spawn(guard.release, "releaser")
    join(releaser)
    join(reader)
    assert guard.released
    assert guard.release() is False  # idempotent
    assert g.stats().open_captures == 0


def test_timeout_names_the_holders_thread_and_call_site() -> None:
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), "holder-thread")
    assert entered.wait(JOIN_S)
    try:
        with pytest.raises(GateTimeout) as info:
            g.begin_capture(timeout=0.05, label="on stream 7")
    finally:
        leave.set()
        join(holder)
    message = str(info.value)
    assert "on stream 7" in message
    assert "'holder-thread'" in message and "shared" in message
    assert "test_gate.py" in message and "hold_section" in message
    # the failed capture left nothing behind
    assert g.stats().open_captures == 0 and not g._closed


def test_measured_sections_run_beside_a_capture_they_cannot_break() -> None:
    g = CaptureGate()
    guard = g.begin_capture(harmful=frozenset({"mem_alloc"}), timeout=1)
    safe = spawn(lambda: g.shared("mem_get_info").__enter__())
    join(safe)  # entered without waiting (it stays inside: its thread ended)

    def unsafe_steps() -> None:
        g.enter("mem_alloc")
        g.exit()

    unsafe = spawn(unsafe_steps)
    assert blocked(unsafe)
    guard.release()
    join(unsafe)
    assert g.stats().admitted_measured == 1


def test_unnamed_sections_wait_under_a_measured_capture() -> None:
    g = CaptureGate()
    guard = g.begin_capture(harmful=frozenset({"mem_alloc"}), timeout=1)

    def other_steps() -> None:
        g.enter()
        g.exit()

    other = spawn(other_steps)
    assert blocked(other)
    guard.release()
    join(other)


def test_teardown_on_the_capturing_thread_is_deferred_to_the_capture_end() -> None:
    g = CaptureGate()
    ran: list[str] = []
    assert not g.defer_if_capturing(ran.append, "no capture")
    with g.begin_capture(timeout=1):
        assert g.defer_if_capturing(ran.append, "freed")
        other = spawn(lambda: ran.append(str(g.defer_if_capturing(ran.append, "x"))))
        join(other)
        assert ran == ["False"]
    assert ran == ["False", "freed"]
    assert g.stats().deferred == 1


def test_tight_capture_loop_does_not_starve_a_waiting_section() -> None:
    g = CaptureGate(fairness_s=0.001)
    stop = threading.Event()

    def capture_loop() -> None:
        while not stop.is_set():
            g.begin_capture(timeout=JOIN_S).release()

    capturer = spawn(capture_loop)
    entered = 0
    for _ in range(50):  # a starved section never gets in: the watchdog fails the test
        with g:
            entered += 1
    stop.set()
    join(capturer)
    assert entered > 0


def test_fork_child_gets_a_fresh_unlocked_gate() -> None:
    g = gate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave))
    assert entered.wait(JOIN_S)
    with g:  # the forking thread's own section survives in the child
        pid = os.fork()
        if pid == 0:  # child: the holder thread does not exist here
            try:
                ok = g.stats().holders[0].thread_id == threading.get_ident()
                g.exit()
                g.enter()
                ok = ok and g.stats().holders[0].depth == 1
                g.exit()
                g.begin_capture(timeout=1).release()
                os._exit(0 if ok and gate() is g else 3)
            except BaseException:
                os._exit(4)
    leave.set()
    join(holder)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
