"""The waits inside a capture gate: entering a shared section, and taking the exclusive side.

Like trio's parking lot beside its locks, this is where threads queue: a section
waits for the capture window to end (or is admitted beside it by the measured
policy), a section nested in an admitted one parks until the window ends, and a
capture waits until no section blocks it. Whatever ends a wait (its timeout, a
signal, an async exception) leaves the thread's record as it found it. The clock and
the poll period are read through the gate (`_now`, `_poll_s`) at each use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from capsafe._gate_release import _GateRelease
from capsafe._gate_state import _NESTED_WAIT, _NOT_WAITING, _SHARED_WAIT, _Record
from capsafe.errors import CapsafeError, UsageError


class GateTimeout(CapsafeError, TimeoutError):
    """A wait at the gate ran out; the message names who holds it and where."""


class _GateWaiting(_GateRelease):
    """Who may enter or capture now, and the waits of those who may not."""

    def _admissible(self, call: str | None) -> bool:
        # Measured policy: a named call the open captures cannot be broken by may run
        # now, unless another capture waits (it must not be starved by admissions).
        harmful = self._harmful
        return (
            call is not None
            and self._owner is not None
            and harmful is not None
            and call not in harmful
            and not self._writers_waiting
        )

    def _refuse_reentry(self, rec: _Record, call: str | None) -> None:
        # A finalizer or signal handler ran a gated call inside this thread's own
        # wait: waiting again there could deadlock, running it could break the
        # capture. Releases are deferred before they get here (defer_if_capturing).
        raise UsageError(
            f"capture gate: {call or 'a gated call'} on thread {rec.thread_name!r} while "
            "that thread waits at the gate (a finalizer or signal handler ran it); only "
            "releases may run there (they are deferred): make the call outside it"
        )

    def _enter_aside(self, rec: _Record, call: str | None) -> None:
        with self._lock:
            if rec is self._owner:
                self._bypassed += 1
                self._bypassed_calls[call or "(unnamed)"] += 1
            elif rec.waiting:
                self._refuse_reentry(rec, call)
            # else: another thread released our capture meanwhile; a plain nested section
            rec.depth += 1

    def _enter_slow(self, rec: _Record, call: str | None) -> None:
        try:
            with self._lock:
                if not self._closed:
                    return  # the capture ended between our store and our look
                if rec is self._owner:
                    self._bypassed += 1
                    self._bypassed_calls[call or "(unnamed)"] += 1
                    return
                rec.depth = 0  # step back out: a draining capture may have counted us
                rec.entered -= 1
                if rec.waiting or rec.aside:
                    self._refuse_reentry(rec, call)
                if self._admissible(call):
                    self._admit(rec)
                else:
                    self._may_capture.notify_all()
                    self._contended += 1
                    self._wait_to_enter(rec, call)
                rec.entered += 1
        finally:
            if self._deferred:
                self._flush_orphans()

    def _admit(self, rec: _Record) -> None:
        rec.depth = -1
        rec.lax_window = self._window
        self._admitted += 1

    def _wait_to_enter(self, rec: _Record, call: str | None) -> None:
        start = self._now()
        deadline = None if self.shared_timeout is None else start + self.shared_timeout
        rec.waiting_since = start
        rec.waiting = _SHARED_WAIT
        try:
            while True:
                if rec.granted or not self._closed:
                    rec.depth = 1  # a capture ended: our turn (the grant is used below)
                    break
                if self._admissible(call):
                    self._admit(rec)
                    break
                remaining = self._remaining(deadline)
                if remaining is not None and remaining <= 0:
                    raise GateTimeout(self._shared_timeout_message(rec, call))
                self._wait(self._may_enter, self.fairness_s)
        finally:
            # Straight-line stores first (no call, so no signal lands between them):
            # the grant is consumed (we entered) or returned (we did not), either way.
            rec.waiting = _NOT_WAITING
            rec.granted = False
            rec.waiting_since = 0.0
            self._may_capture.notify_all()
            self._note_wait(self._now() - start)

    def _enter_nested_admitted(self, rec: _Record, call: str | None) -> None:
        # Nested inside a section admitted beside an open capture: a call that
        # could break that capture waits ("parked") until the window ends. A parked
        # thread runs no driver code, so the owner's nested captures do not wait for
        # it (no cycle); other threads' captures do, so nothing overlaps its section.
        with self._lock:
            if rec.lax_window == self._window and self._owner is not None:
                if self._admissible(call):
                    rec.depth -= 1
                    return
                if rec.waiting:
                    self._refuse_reentry(rec, call)
                start = self._now()
                deadline = None if self.shared_timeout is None else start + self.shared_timeout
                self._contended += 1
                rec.waiting_since = start
                rec.waiting = _NESTED_WAIT
                try:
                    while rec.lax_window == self._window and self._owner is not None:
                        remaining = self._remaining(deadline)
                        if remaining is not None and remaining <= 0:
                            raise GateTimeout(self._shared_timeout_message(rec, call))
                        self._wait(
                            self._may_enter, self._poll_s() if remaining is None else remaining
                        )
                finally:
                    rec.waiting = _NOT_WAITING
                    rec.waiting_since = 0.0
                    self._note_wait(self._now() - start)
            rec.depth = -rec.depth + 1

    def _wait(self, condition: threading.Condition, timeout: float) -> None:
        try:
            condition.wait(timeout)
        except BaseException:
            # Condition.wait can raise with the lock released (a signal just after it let
            # go); the caller's `with self._lock` must still find it held.
            if not self._lock._is_owned():  # type: ignore[attr-defined]
                self._lock.acquire()
            raise

    def _wake(self) -> None:
        with self._lock:
            self._may_capture.notify_all()

    def _wait_until(self, ready: Callable[[], bool], timeout: float | None, label: str) -> None:
        if ready():
            return
        self._capture_waits += 1
        start = self._now()
        deadline = None if timeout is None else start + timeout
        self._capture_sleepers += 1  # a store, then the try: a release from now wakes us
        try:
            while not ready():
                remaining = self._remaining(deadline)
                if remaining is not None and remaining <= 0:
                    raise GateTimeout(self._timeout_message(label, timeout))
                self._wait(
                    self._may_capture,
                    self._poll_s() if remaining is None else min(remaining, self._poll_s()),
                )
        finally:
            self._capture_sleepers -= 1
            self._note_wait(self._now() - start)

    def _grants_pending(self) -> bool:
        # A grant counts only while its thread still waits for it (and lives).
        return any(r.granted and r.waiting == _SHARED_WAIT and not r.dead() for r in self._records)

    def _blocking_records(self, me: _Record) -> list[_Record]:
        # Sections of threads that have exited run nothing: they block no one.
        return [
            r for r in self._records if r.depth and not r.aside and r is not me and not r.dead()
        ]

    def _running_admitted(self, me: _Record) -> list[_Record]:
        # Admitted sections that may be in the driver now: not parked, not waiting to
        # begin a capture of their own (both run no driver code until we end).
        return [
            r
            for r in self._records
            if r.depth < 0
            and r is not me
            and not r.aside
            and r.waiting == _NOT_WAITING
            and not r.dead()
        ]

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else deadline - self._now()
