"""A signal inside the teardown a capture's end runs: nothing queued is lost, the signal goes on.

Written for the six mutants of the gate's recovery code that survived the whole-gate
mutation run of 2026-12-02 (docs/gate.md): the `raise` and the give-back of an orphan
flush, the `raise` and the put-back of queued teardown, and both put-backs overwriting
the queue's first entry (`[:1]` for `[:0]`) instead of going in front of it. Each test
lands a signal (here: an exception raised by the deferred call itself, where a signal
would land while it runs) inside one of those queues while another entry is queued
behind the run, and asserts that the caller sees that signal and that every other
entry still runs once.
"""

from __future__ import annotations

import threading

import pytest
from test_gate import JOIN_S, Spawned, hold_section, join, spawn
from test_gate_failures import Second
from test_gate_regressions import CallbackCondition

from capsafe.gate import CaptureGate

pytestmark = pytest.mark.timeout(60)


def test_a_signal_in_an_orphan_flush_keeps_the_rest_queued_and_reaches_the_caller() -> None:
    """A capture's wait ends in a signal with a finalizer's releases deferred in it: the
    orphan flush runs them. A second signal in the first one must reach the caller, and
    the other release go back in front of one another thread's capture queued meanwhile;
    that capture's end runs both."""
    g = CaptureGate()
    entered, leave = threading.Event(), threading.Event()
    holder = spawn(lambda: hold_section(g, entered, leave), name="holder")
    assert entered.wait(JOIN_S)
    ran: list[str] = []
    other_queued, other_end = threading.Event(), threading.Event()

    def other_capture() -> None:
        with g.begin_capture(timeout=JOIN_S):
            assert g.defer_if_capturing(ran.append, "other's release")
            other_queued.set()
            assert other_end.wait(JOIN_S)

    others: list[Spawned] = []

    def interrupted_release() -> None:
        # Runs in the orphan flush, on the capturer's thread: the section it waited for
        # ends and another thread's capture queues a release before the signal lands.
        leave.set()
        join(holder)
        others.append(spawn(other_capture, name="other"))
        assert other_queued.wait(JOIN_S)
        ran.append("interrupted")
        raise Second

    def finalizer_then_signal() -> None:
        assert g.defer_if_capturing(interrupted_release)
        assert g.defer_if_capturing(ran.append, "after")
        raise KeyboardInterrupt

    g._may_capture = CallbackCondition(g._lock, "capturer", finalizer_then_signal)
    raised: list[BaseException] = []

    def capturer() -> None:
        try:
            g.begin_capture(timeout=JOIN_S)
        except BaseException as exc:
            raised.append(exc)

    join(spawn(capturer, name="capturer"))
    assert len(raised) == 1 and isinstance(raised[0], Second), raised
    assert isinstance(raised[0].__context__, KeyboardInterrupt)
    assert ran == ["interrupted"]  # the rest waits for the open capture's end
    other_end.set()
    join(others[0])
    assert ran == ["interrupted", "after", "other's release"]
    with g.begin_capture(timeout=JOIN_S):  # nothing left to run, nothing held
        pass
    assert ran == ["interrupted", "after", "other's release"]
    assert g.stats().holders == ()


def test_a_signal_in_queued_teardown_keeps_the_rest_queued_and_reaches_the_caller() -> None:
    """Teardown queued behind a capture runs at its end, under the gate's lock. A signal in
    one destroy, after it queued another, must reach the releasing caller, and the
    interrupted release's finish run the rest, the newly queued one included, once."""
    g = CaptureGate()
    ran: list[str] = []

    def interrupted_destroy() -> None:
        ran.append("interrupted")
        assert g.defer_while_closed(ran.append, "queued meanwhile")  # the window is not over
        raise Second

    guard = g.begin_capture(timeout=JOIN_S)
    queue = spawn(
        lambda: [
            g.defer_while_closed(interrupted_destroy),
            g.defer_while_closed(ran.append, "after"),
        ],
        name="helper",
    )
    join(queue)
    assert ran == []
    with pytest.raises(Second):
        guard.release()
    assert ran == ["interrupted", "after", "queued meanwhile"]
    assert guard.released and not g.owned_by_current_thread()
    assert g.stats().holders == ()
    done: list[bool] = []
    join(spawn(lambda: done.append(g.begin_capture(timeout=JOIN_S).release()), name="next"))
    assert done == [True] and ran == ["interrupted", "after", "queued meanwhile"]
