"""The process-wide capture gate: a reader/writer gate between captures and what breaks them.

A capture holds the *exclusive* side for its whole begin..end window; every
driver call that can break a capture holds the *shared* side while it runs. So
no such call can run on another thread while a capture is open, and a capture
waits for the ones already running to finish.

Load-bearing details (each has a test in tests/core/test_gate*.py):

- the thread that owns the exclusive side bypasses the shared side: a capture
  may allocate inside its own window (RELAXED mode, VMM);
- a capture that is waiting blocks *new* shared sections (writer preference),
  so busy allocator threads cannot starve it;
- shared sections are re-entrant per thread without waiting, so a nested call
  never deadlocks on a capture that waits for its outer section;
- a thread waiting for (or holding) the exclusive side has its own shared
  sections set aside, so two threads that each hold one and both begin a
  capture do not wait on each other forever;
- the `CaptureGuard` returned by `begin_capture` may be released from another
  thread;
- after `os.fork` every gate in the child is fresh and unlocked;
- a section that has waited `fairness_s` enters at the next capture end, ahead
  of the next capture, so a tight capture loop cannot starve allocator threads;
- every wait is exception-safe: whatever ends it (Ctrl-C, an async exception,
  pytest-timeout's signal) consumes or returns what it was given, and every wait
  has a timeout raising `GateTimeout` that names the holders;
- a gated call from a finalizer or signal handler on a thread that is waiting
  inside the gate is deferred (releases) or refused (`UsageError`), never run
  beside a capture or waited for inside the wait.

The uncontended shared section costs one thread-local lookup and a few
attribute stores, no lock: each thread publishes its depth in its own record
and reads one `closed` flag; a capture sets `closed` and then scans the
records (under the GIL the store-then-load order makes this a Dekker handshake;
the lock is only taken when the flag is set). Call sites are not recorded on the
fast path: the timeout error reads the holders' live stacks instead.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from capsafe import _state
from capsafe._diagnostics import (
    Holder,
    Site,
    capture_timeout_message,
    current_frames,
    format_site,
    holder_site,
    outer_site,
    shared_timeout_message,
    site_of,
)
from capsafe.errors import CapsafeError, UsageError, raised_here

log = logging.getLogger("capsafe")

DEFAULT_CAPTURE_TIMEOUT_S = 60.0
#: How long a shared section waits for a capture window before `GateTimeout`.
DEFAULT_SHARED_TIMEOUT_S = 60.0
#: A waiting capture re-checks this often (a holder's thread may have exited).
_POLL_S = 0.05
# What a thread is waiting for inside the gate (`_Record.waiting`).
_NOT_WAITING, _SHARED_WAIT, _NESTED_WAIT, _CAPTURE_WAIT = 0, 1, 2, 3
#: A shared section that waited this long enters at the next capture end, ahead of
#: the next capture (and a waiting section re-checks the gate this often).
DEFAULT_FAIRNESS_S = 0.001
_Deferred = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class GateTimeout(CapsafeError, TimeoutError):
    """A wait at the gate ran out; the message names who holds it and where."""


@dataclass(frozen=True)
class GateStats:
    """Counters since the gate was created (or since fork)."""

    shared_entered: int  # outermost shared sections entered (nested re-entries not counted)
    contended_waits: int  # shared sections that had to wait for a capture
    capture_waits: int  # captures that had to wait for shared holders or another capture
    max_wait_s: float  # the longest single wait, shared or capture
    bypassed: int  # shared sections the capturing thread entered inside its own window
    admitted_measured: int  # sections the measured policy let run beside an open capture
    captures: int  # exclusive windows taken
    deferred: int  # callables deferred to the end of a capture (teardown during capture)
    open_captures: int
    holders: tuple[Holder, ...]


class _Record:
    """One thread's view of the gate. Only its own thread writes `depth` and `entered`.

    depth > 0: nested shared sections; depth < 0: sections the measured policy
    admitted beside an open capture (see `CaptureGate.enter`); 0: none.
    Written under the gate lock: `aside` marks a thread waiting for or holding
    the exclusive side (its shared sections do not block other captures);
    `waiting` what the thread waits for inside the gate; `granted` an entry
    ahead of the next capture, which counts only while the thread still waits.
    """

    __slots__ = (
        "__weakref__",
        "aside",
        "depth",
        "entered",
        "granted",
        "lax_window",
        "name",
        "thread",
        "thread_id",
        "waiting",
        "waiting_since",
    )

    def __init__(self) -> None:
        current = threading.current_thread()
        self.depth = 0
        self.entered = 0
        self.aside = False
        self.granted = False
        self.lax_window = 0
        self.waiting = _NOT_WAITING
        self.waiting_since = 0.0
        self.thread = weakref.ref(current)
        self.thread_id = threading.get_ident()
        self.name = current.name  # kept for messages after the thread has gone

    @property
    def thread_name(self) -> str:
        thread = self.thread()
        if thread is not None:
            self.name = thread.name
        return self.name

    def dead(self) -> bool:
        thread = self.thread()
        return thread is None or not thread.is_alive()


class CaptureGuard:
    """The exclusive side held for one capture window; `release()` may run on any thread."""

    __slots__ = (
        "_gate",
        "_generation",
        "_released",
        "_site",
        "harmful",
        "label",
        "record",
        "started",
    )

    def __init__(
        self,
        gate: CaptureGate,
        record: _Record,
        harmful: frozenset[str] | None,
        label: str,
        site: Site,
    ) -> None:
        self._gate = gate
        self._generation = gate._generation
        self._released = False
        self.record = record
        self.harmful = harmful
        self.label = label
        self._site = site
        self.started = time.monotonic()

    @property
    def site(self) -> str:
        """Where the capture began (the first caller outside capsafe)."""
        return format_site(self._site)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def thread_name(self) -> str:
        return self.record.thread_name

    def release(self) -> bool:
        """Give the exclusive side back and run deferred teardown; False if already released.

        An exception that lands inside (a signal at the internal release's entry, in a
        wake-up) is caught, the release finished, and the exception raised again: the
        guard is never left registered by a release that raised.
        """
        try:
            return self._gate._release(self)
        except BaseException:
            self._gate._finish_release(self)
            raise

    def __enter__(self) -> CaptureGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class CaptureGate:
    """One reader/writer gate; use `gate()` for the process-wide instance.

    `enter()`/`exit()` (or `with gate:` / `with gate.shared(call):`) bracket a
    call that can break a capture; `begin_capture()` returns the guard for a
    capture window. The gate holds no policy: a section that names its call may
    run beside an open capture whose `harmful` set (the calls that can break it,
    from the hazard table) does not contain that call — the measured policy. A
    section without a name, or a capture with `harmful=None`, never allows this
    — the conservative policy. `shared_timeout`: seconds a section waits for a
    capture window before `GateTimeout` (None waits forever).
    """

    def __init__(
        self,
        *,
        fairness_s: float = DEFAULT_FAIRNESS_S,
        shared_timeout: float | None = DEFAULT_SHARED_TIMEOUT_S,
    ) -> None:
        self.fairness_s = fairness_s
        self.shared_timeout = shared_timeout
        self._init_state()
        _live_gates.add(self)

    def _init_state(self, keep: _Record | None = None) -> None:
        # Re-entrant: a finalizer the GC runs while this thread is inside the
        # gate's own code may call back into the gate.
        self._lock = threading.RLock()
        self._may_enter = threading.Condition(self._lock)  # shared sections wait here
        self._may_capture = threading.Condition(self._lock)  # captures wait here
        self._tls = threading.local()
        self._records: list[_Record] = []
        if keep is not None:  # the thread that forked keeps its own open sections
            keep.aside = keep.granted = False
            keep.waiting = _NOT_WAITING
            keep.thread = weakref.ref(threading.current_thread())
            keep.name = threading.current_thread().name
            keep.thread_id = threading.get_ident()
            self._tls.rec = keep
            self._records.append(keep)
        self._owner: _Record | None = None
        self._guards: list[CaptureGuard] = []
        self._harmful: frozenset[str] | None = frozenset()
        self._window = 0  # bumped at every exclusive acquisition
        self._writers_waiting = 0
        self._closed = False  # a capture holds or waits for the exclusive side
        self._deferred: list[_Deferred] = []
        self._teardown: list[_Deferred] = []  # other threads' destroys, run at the window's end
        self._generation = getattr(self, "_generation", 0) + 1
        self._retired_entered = 0
        self._contended = self._capture_waits = self._bypassed = self._admitted = 0
        self._captures = self._deferred_total = 0
        self._max_wait = 0.0
        self._bypassed_calls: Counter[str] = Counter()

    # -- shared side ----------------------------------------------------------
    def _record(self) -> _Record:
        try:
            return self._tls.rec  # type: ignore[no-any-return]
        except AttributeError:
            rec = self._tls.rec = _Record()
            with self._lock:
                self._prune()
                self._records.append(rec)
            return rec

    def enter(self, call: str | None = None) -> None:
        """Open a shared section around one call (named by its hazard-table call, if known)."""
        try:
            rec = self._tls.rec
        except AttributeError:
            rec = self._record()
        depth = rec.depth
        if depth > 0 and not rec.aside:
            rec.depth = depth + 1
            return
        if depth == 0:
            rec.depth = 1  # publish first, then look: the capture sets `closed`, then scans
            rec.entered += 1
            if not self._closed:
                return
        # The slow paths. An exception from them (a signal can land at any call) leaves
        # no section behind: the store below runs before anything else can.
        try:
            if depth > 0:  # a capture's own thread, or a finalizer while it waits to begin
                self._enter_aside(rec, call)
            elif depth < 0:
                self._enter_nested_admitted(rec, call)
            else:
                self._enter_slow(rec, call)
        except BaseException:
            rec.depth = depth
            self._wake()
            raise

    def exit(self, *_exc: object) -> None:
        """Close the innermost shared section of this thread (also `__exit__`)."""
        try:
            rec = self._tls.rec
        except AttributeError:
            raise UsageError(_NO_SECTION) from None
        depth = rec.depth
        if depth > 1:
            rec.depth = depth - 1
        elif depth == 1:
            rec.depth = 0
            if self._closed:
                self._wake()
        elif depth < 0:
            rec.depth = depth + 1
            if depth == -1:
                self._wake()
        else:
            raise UsageError(_NO_SECTION)

    # `with gate:` is a shared section; aliases save a Python call on the hot path
    # (so `with gate as x` binds None).
    __enter__ = enter
    __exit__ = exit

    @contextmanager
    def shared(self, call: str | None = None) -> Iterator[None]:
        """`with gate.shared("mem_alloc"):` — a shared section naming its call."""
        self.enter(call)
        try:
            yield
        finally:
            self.exit()

    def wrap(
        self,
        fn: Callable[..., Any],
        call: str | None = None,
        classify: Callable[..., str | None] | None = None,
    ) -> Callable[..., Any]:
        """`fn` inside one shared section named `call` (or `classify(*args)`; None runs it
        ungated), closed however the call ends.

        Also when a signal lands between `enter()` returning and the call, or at the
        entry of `exit()`: the first is told by the exception's traceback (`errors.raised_here`:
        it did not come from inside `enter`), the second by the depth that
        `exit()` did not change. Either way the section is closed and the exception
        raised on; nothing is added to the uncontended path but two attribute loads.
        """
        enter, exit_, tls = self.enter, self.exit, self._tls

        def section(name: str | None, *args: Any, **kwargs: Any) -> Any:
            try:
                enter(name)
            except BaseException as exc:
                if raised_here(exc, enter):  # it landed after enter returned: the section is ours
                    depth = tls.rec.depth
                    try:
                        exit_()
                    except BaseException:
                        if tls.rec.depth == depth:
                            exit_()
                        raise
                raise
            try:
                result = fn(*args, **kwargs)  # stored, not returned: see the finally below
            finally:
                # Not reached by a `return` inside the try: CPython copies the finally
                # body after that return's call, outside the try, where a signal would
                # skip it.
                depth = tls.rec.depth
                try:
                    exit_()
                except BaseException:
                    if tls.rec.depth == depth:  # it landed before exit() changed anything
                        exit_()
                    raise
            return result

        if classify is None:
            return functools.partial(section, call)  # no second Python frame on the hot path

        def by_args(*args: Any, **kwargs: Any) -> Any:
            name = classify(*args, **kwargs)
            if name is None:
                return fn(*args, **kwargs)
            return section(name, *args, **kwargs)

        return by_args

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
        start = time.monotonic()
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
                remaining = _remaining(deadline)
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
            self._note_wait(time.monotonic() - start)

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
                start = time.monotonic()
                deadline = None if self.shared_timeout is None else start + self.shared_timeout
                self._contended += 1
                rec.waiting_since = start
                rec.waiting = _NESTED_WAIT
                try:
                    while rec.lax_window == self._window and self._owner is not None:
                        remaining = _remaining(deadline)
                        if remaining is not None and remaining <= 0:
                            raise GateTimeout(self._shared_timeout_message(rec, call))
                        self._wait(self._may_enter, _POLL_S if remaining is None else remaining)
                finally:
                    rec.waiting = _NOT_WAITING
                    rec.waiting_since = 0.0
                    self._note_wait(time.monotonic() - start)
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

    def _note_wait(self, seconds: float) -> None:
        if seconds > self._max_wait:
            self._max_wait = seconds

    # -- exclusive side -----------------------------------------------------------
    def begin_capture(
        self,
        *,
        harmful: frozenset[str] | None = None,
        label: str = "",
        timeout: float | None = DEFAULT_CAPTURE_TIMEOUT_S,
        into: list[CaptureGuard] | None = None,
    ) -> CaptureGuard:
        """Take the exclusive side for one capture window.

        `harmful`: the hazard-table calls that break this capture from another
        thread (None: every gated call; only the measured policy looks at it).
        `timeout`: seconds to wait before raising `GateTimeout` naming the holders
        (None waits forever). The calling thread may already be inside shared
        sections (they are set aside) or own the gate (captures nest). Whatever
        ends a wait here, nothing is left registered. `into`: a list the guard is
        appended to in the same step that registers it, so a caller whose code a
        signal interrupts right after this call returns still finds (and releases) it.
        """
        rec = self._record()
        site = outer_site(sys._getframe(1))
        made: list[CaptureGuard] = [] if into is None else into
        try:
            # No orphan flush on success: this thread owns the gate now, so the releases
            # deferred meanwhile run at its capture's end (_release), not before.
            return self._begin(rec, harmful, label, site, timeout, made)
        except BaseException:
            for guard in made:  # a signal landed after the registration: give it back
                guard.release()
            if self._deferred:
                self._flush_orphans()
            raise

    def _begin(
        self,
        rec: _Record,
        harmful: frozenset[str] | None,
        label: str,
        site: Site,
        timeout: float | None,
        made: list[CaptureGuard],
    ) -> CaptureGuard:
        with self._lock:
            if rec is self._owner:
                nested = self._begin_nested(rec, harmful, label, site, timeout, made)
                if nested is not None:
                    return nested
            if rec.waiting:
                self._refuse_reentry(rec, "begin_capture")
            guard = CaptureGuard(self, rec, harmful, label, site)  # before any state changes
            rec.aside = True  # our own sections no longer block anyone's capture
            rec.waiting = _CAPTURE_WAIT
            self._writers_waiting += 1
            self._closed = True
            try:
                self._may_capture.notify_all()
                self._wait_until(
                    lambda: (
                        self._owner is None
                        and not self._grants_pending()
                        and not self._blocking_records(rec)
                    ),
                    timeout,
                    label,
                )
            except BaseException:
                rec.aside = False
                rec.waiting = _NOT_WAITING
                self._writers_waiting -= 1
                self._closed = self._owner is not None or self._writers_waiting > 0
                # Sections waited on us: let them look again. Captures need no wake-up:
                # our giving up (aside and waiting cleared) makes no capture's wait ready.
                self._may_enter.notify_all()
                if not self._closed and self._teardown:
                    self._run_teardown_locked()  # the window it waited for never came
                raise
            # Stores only until the guard is registered (see _release).
            rec.waiting = _NOT_WAITING
            self._writers_waiting -= 1
            self._owner = rec  # `_closed` stays True: it was, for as long as we waited
            self._window += 1
            self._harmful = harmful
            self._guards += (guard,)  # a store, not a call: nothing lands before it
            made.append(guard)
            self._captures += 1
            if harmful is not None:  # the measured policy may let waiting sections in
                self._may_enter.notify_all()
            return guard

    def _begin_nested(
        self,
        rec: _Record,
        harmful: frozenset[str] | None,
        label: str,
        site: Site,
        timeout: float | None,
        made: list[CaptureGuard],
    ) -> CaptureGuard | None:
        # Called under the lock by the owner. Widen the set first, so nothing new is
        # admitted under the narrower one, then drain the admitted sections still
        # running; the guard is registered only once that succeeded. None: another
        # thread released our outer capture meanwhile, so this one is not nested.
        self._harmful = _union(self._harmful, harmful)
        try:
            self._wait_until(
                lambda: self._owner is not rec or not self._running_admitted(rec), timeout, label
            )
        except BaseException:
            if self._owner is rec:
                self._harmful = _union_all(g.harmful for g in self._guards)
            raise
        if self._owner is not rec:
            return None
        guard = CaptureGuard(self, rec, harmful, label, site)
        self._guards += (guard,)
        made.append(guard)
        self._captures += 1
        return guard

    def _wait_until(self, ready: Callable[[], bool], timeout: float | None, label: str) -> None:
        if ready():
            return
        self._capture_waits += 1
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        try:
            while not ready():
                remaining = _remaining(deadline)
                if remaining is not None and remaining <= 0:
                    raise GateTimeout(self._timeout_message(label, timeout))
                self._wait(
                    self._may_capture, _POLL_S if remaining is None else min(remaining, _POLL_S)
                )
        finally:
            self._note_wait(time.monotonic() - start)

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

    def _release(self, guard: CaptureGuard) -> bool:
        deferred: list[_Deferred] = []
        try:
            with self._lock:
                if guard._released:
                    return False
                if guard._generation != self._generation:
                    guard._released = True
                    return True  # taken before fork: the child's gate never held it
                remaining = [g for g in self._guards if g is not guard]
                if not remaining and self._teardown:
                    self._run_teardown_locked()  # still exclusive: nothing begins beside it
                # Stores only from here to the end of the transition: a signal lands at a
                # call, so the gate is never left half released (owner kept, guard gone).
                guard._released = True
                self._guards = remaining
                if remaining:
                    self._harmful = _union_all(g.harmful for g in remaining)
                    return True
                guard.record.aside = False
                self._owner = None
                self._harmful = _NOTHING
                self._closed = self._writers_waiting > 0
                if self._wake_waiting_sections():
                    self._may_enter.notify_all()
                self._may_capture.notify_all()
                # Taken last: a signal at a wake-up above leaves them on the gate, for
                # _finish_release to run.
                deferred, self._deferred = self._deferred, []
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
        oldest_allowed = time.monotonic() - self.fairness_s
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

    def owned_by_current_thread(self) -> bool:
        """True while this thread holds the exclusive side (a capture of its own is open)."""
        owner = self._owner
        return owner is not None and getattr(self._tls, "rec", None) is owner

    def bypassed_calls(self) -> Counter[str]:
        """Calls capturing threads made inside their own windows, by name (a copy)."""
        with self._lock:
            return Counter(self._bypassed_calls)

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

    # -- observability --------------------------------------------------------
    def holders(self) -> tuple[Holder, ...]:
        """Threads holding or waiting for the gate now, with call sites from their live stacks."""
        with self._lock:
            return self._holders_locked()

    def _holders_locked(self, skip: _Record | None = None) -> tuple[Holder, ...]:
        # Threads are told apart by their record (one per live Thread object), never by
        # ident: a new thread may reuse an exited holder's ident.
        frames = current_frames()
        owner_guard = self._guards[0] if self._guards else None
        out = []
        for rec in self._records:
            if rec is skip:
                continue
            dead = rec.dead()
            if rec is self._owner:
                role = "capture"
            elif rec.aside:
                role = "waiting capture"
            elif rec.granted and rec.waiting == _SHARED_WAIT:
                role = "granted entry"
            elif rec.depth and not dead:
                role = "shared"
            else:
                continue
            frame = None if dead else frames.get(rec.thread_id)  # a reused ident is not ours
            site = holder_site(frame)
            if role == "capture" and owner_guard is not None:
                site = owner_guard._site
            out.append(
                Holder(
                    rec.thread_name,
                    rec.thread_id,
                    role,
                    abs(rec.depth),
                    format_site(site),
                    format_site(site_of(frame)),
                    exited=dead,
                )
            )
        return tuple(out)

    def _others(self) -> tuple[Holder, ...]:
        return self._holders_locked(skip=getattr(self._tls, "rec", None))

    def _timeout_message(self, label: str, timeout: float | None) -> str:
        return capture_timeout_message(label, timeout, self._others())

    def _shared_timeout_message(self, rec: _Record, call: str | None) -> str:
        guard = self._guards[0] if self._guards else None
        label = guard.label if guard is not None else ""
        return shared_timeout_message(
            call, rec.thread_name, self.shared_timeout, label, self._others()
        )

    def stats(self) -> GateStats:
        with self._lock:
            self._prune()
            entered = self._retired_entered + sum(r.entered for r in self._records)
            return GateStats(
                shared_entered=entered,
                contended_waits=self._contended,
                capture_waits=self._capture_waits,
                max_wait_s=self._max_wait,
                bypassed=self._bypassed,
                admitted_measured=self._admitted,
                captures=self._captures,
                deferred=self._deferred_total,
                open_captures=len(self._guards),
                holders=self._holders_locked(),
            )

    def _prune(self) -> None:
        # Forget threads that ended and own nothing (called under the lock).
        if len(self._records) < 8:
            return
        keep = []
        for rec in self._records:
            if rec.dead() and rec is not self._owner:
                self._retired_entered += rec.entered
            else:
                keep.append(rec)
        self._records = keep

    def _after_fork_in_child(self) -> None:
        keep = getattr(self._tls, "rec", None)
        self._init_state(keep)


_NOTHING: frozenset[str] = frozenset()
_NO_SECTION = "capture gate: exit() without a matching enter() on this thread"


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _union(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return None if a is None or b is None else a | b


def _union_all(sets: Iterator[frozenset[str] | None]) -> frozenset[str] | None:
    out: frozenset[str] | None = frozenset()
    for s in sets:
        out = _union(out, s)
    return out


def _run_deferred(deferred: list[_Deferred]) -> None:
    """Run and remove each in turn: what an exception stops before it runs stays listed."""
    while deferred:
        fn, args, kwargs = deferred.pop(0)
        try:
            fn(*args, **kwargs)
        except Exception:  # one failed release must not leak the others
            log.exception("capsafe: deferred teardown %s failed", getattr(fn, "__name__", fn))


_live_gates: weakref.WeakSet[CaptureGate] = weakref.WeakSet()
_process_gate: CaptureGate | None = None
_process_gate_lock = threading.Lock()


def gate() -> CaptureGate:
    """The process-wide gate that the driver facade and `capsafe.capture` share."""
    global _process_gate
    if _process_gate is None:
        with _process_gate_lock:
            if _process_gate is None:
                _process_gate = CaptureGate()
    return _process_gate


@_state.on_reset
def _reset(forked: bool) -> None:
    # A forked child: every gate fresh and unlocked. Between tests: a new process gate
    # (the facades that held the old one are reset too).
    global _process_gate_lock, _process_gate
    if not forked:
        _process_gate = None
        return
    _process_gate_lock = threading.Lock()
    for live in list(_live_gates):
        live._after_fork_in_child()
