"""The end of a capture window, and the teardown deferred to it.

A release hands the exclusive side back, wakes who waited for it, and runs what was
queued behind the window: releases a finalizer deferred mid-capture
(`defer_if_capturing`) and other threads' destroys (`defer_while_closed`). A signal
may land anywhere here, so every queue is taken off the gate only when it is about to
run, each entry is removed as it runs, and what a signal stops before it runs goes
back on the gate for the next capture end (or the interrupted release's finish).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from capsafe._gate_state import (
    _NESTED_WAIT,
    _NOTHING,
    _SHARED_WAIT,
    _Deferred,
    _union,
    _union_all,
)
from capsafe._gate_stats import _GateObservability

if TYPE_CHECKING:
    from capsafe.gate import CaptureGuard

log = logging.getLogger("capsafe")


class _GateRelease(_GateObservability):
    """Ending a capture window and running what was deferred to its end."""

    def _release(self, guard: CaptureGuard) -> bool:
        deferred: list[_Deferred] = []
        try:
            with self._lock:
                if guard._released:
                    return False
                if guard._generation != self._generation:
                    guard._released = True
                    return True  # taken before fork: the child's gate never held it
                guards = self._guards
                if len(guards) == 1 and guards[0] is guard:  # the only window: nothing to filter
                    remaining = []
                else:
                    remaining = [g for g in guards if g is not guard]
                if not remaining and self._teardown:
                    self._run_teardown_locked()  # still exclusive: nothing begins beside it
                # Stores only from here to the end of the transition: a signal lands at a
                # call, so the gate is never left half released (owner kept, guard gone).
                guard._released = True
                self._guards = remaining
                if remaining:  # a nested begin the owner waits in keeps its widening
                    owner = self._owner
                    widening = _NOTHING if owner is None else owner.widening
                    self._harmful = _union(_union_all(g.harmful for g in remaining), widening)
                    return True
                guard.record.aside = False
                self._owner = None
                self._harmful = _NOTHING
                self._closed = self._writers_waiting > 0
                # The wake-ups only where a thread waits (a tight capture loop has none,
                # and each is Python calls): a section marks its record `waiting` under the
                # lock before it sleeps, a capture (nested ones too) counts itself in
                # `_capture_sleepers`.
                for rec in self._records:
                    if rec.waiting:
                        if self._wake_waiting_sections():
                            self._may_enter.notify_all()
                        break
                if self._capture_sleepers:
                    self._may_capture.notify_all()
                # Taken last: a signal at a wake-up above leaves them on the gate, for
                # _finish_release to run.
                deferred, self._deferred = self._deferred, []
            if deferred:
                _run_deferred(deferred)
        except BaseException:
            self._give_back(deferred)
            raise
        return True

    def _finish_release(self, guard: CaptureGuard) -> None:
        # A release an exception interrupted: finish it (a no-op when it got that far),
        # then do the wake-ups and deferred teardown it may have skipped.
        self._release(guard)
        with self._lock:
            self._may_enter.notify_all()
            self._may_capture.notify_all()
        if self._deferred:
            self._flush_orphans()

    def _wake_waiting_sections(self) -> bool:
        # Sections that waited fairness_s or longer enter before the next capture, so
        # a tight capture loop cannot starve allocator threads. Younger waiters are
        # not woken: they re-check every fairness_s, and waking them at every capture
        # end would cost more than the capture. Parked sections may go on now.
        oldest_allowed = self._now() - self.fairness_s
        wake = False
        for rec in self._records:
            if rec.waiting == _SHARED_WAIT and rec.waiting_since <= oldest_allowed:
                rec.granted = wake = True
            elif rec.waiting == _NESTED_WAIT:
                wake = True
        return wake

    def _flush_orphans(self) -> None:
        # Releases deferred from a finalizer on a waiting thread run at the next capture
        # end; when no capture is open or coming, that is now.
        with self._lock:
            if self._owner is not None or self._writers_waiting or not self._deferred:
                return
            deferred, self._deferred = self._deferred, []
        try:
            _run_deferred(deferred)
        except BaseException:
            self._give_back(deferred)
            raise

    def _give_back(self, deferred: list[_Deferred]) -> None:
        # Deferred releases taken off the gate that a signal stopped before they ran go
        # back to its queue (the next capture end, or _finish_release, runs them).
        if deferred:
            with self._lock:
                self._deferred[:0] = deferred

    def defer_if_capturing(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Queue `fn(*args, **kwargs)` until the capture ends; False when it may run now.

        It may not run now when this thread's own capture is open (a finalizer the
        GC runs mid-capture would break it) or when this thread is waiting inside
        the gate (a finalizer or signal handler landed in the wait). Deferring a
        release only delays it.
        """
        rec = getattr(self._tls, "rec", None)
        if rec is None or (rec is not self._owner and not rec.waiting):
            return False
        # No lock: list.append is atomic, and a finalizer may run while this thread
        # is inside the gate's own code.
        self._deferred.append((fn, args, kwargs))
        self._deferred_total += 1
        return True

    def defer_while_closed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Queue teardown that must neither wait nor run beside a capture; False: run it now.

        While any thread's capture holds or waits for the exclusive side, `fn` runs
        at that capture's end (at once if none is open or coming by then), so the
        caller never stalls: a helper that ends captures for other threads and
        destroys their finished graphs does not wait for the next capture. Errors
        of the deferred call are logged.
        """
        with self._lock:  # not the hot path: a graph executable's destroy
            if not self._closed:
                return False
            self._teardown.append((fn, args, kwargs))
            self._deferred_total += 1
        return True

    def _run_teardown_locked(self) -> None:
        # Called under the lock while no other thread can begin a capture (the ending
        # one still holds the exclusive side, or none holds or waits for it).
        teardown, self._teardown = self._teardown, []
        try:
            _run_deferred(teardown)
        except BaseException:
            self._teardown[:0] = teardown  # those a signal stopped before they ran
            raise


def _run_deferred(deferred: list[_Deferred]) -> None:
    """Run and remove each in turn: what an exception stops before it runs stays listed."""
    while deferred:
        fn, args, kwargs = deferred.pop(0)
        try:
            fn(*args, **kwargs)
        except Exception:  # one failed release must not leak the others
            log.exception("capsafe: deferred teardown %s failed", getattr(fn, "__name__", fn))
