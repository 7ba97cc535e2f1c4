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

This module is the public API: the shared side's fast path (`enter`, `exit`,
`wrap`), `begin_capture`, the guard, and the process-wide gate. The rest of
`CaptureGate` is built from one class per role, each deriving from the one below:
`_gate_state` (the per-thread records and the fields), `_gate_stats` (counters,
holders), `_gate_release` (a window's end and the teardown deferred to it) and
`_gate_waiting` (the waits to enter and to capture).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from capsafe import _state
from capsafe._diagnostics import Site, current_frames, format_site, outer_site
from capsafe._gate_state import _CAPTURE_WAIT, _NOT_WAITING, _NOTHING, _union, _union_all
from capsafe._gate_state import _Record as _Record  # re-exported: tests name the record type
from capsafe._gate_stats import GateStats
from capsafe._gate_waiting import GateTimeout, _GateWaiting
from capsafe.errors import UsageError, raised_here

__all__ = [
    "DEFAULT_CAPTURE_TIMEOUT_S",
    "DEFAULT_FAIRNESS_S",
    "DEFAULT_SHARED_TIMEOUT_S",
    "CaptureGate",
    "CaptureGuard",
    "GateStats",
    "GateTimeout",
    "current_frames",
    "gate",
]

# Their public home, as in tracebacks and pickles before the gate was split by role.
GateTimeout.__module__ = GateStats.__module__ = __name__

DEFAULT_CAPTURE_TIMEOUT_S = 60.0
#: How long a shared section waits for a capture window before `GateTimeout`.
DEFAULT_SHARED_TIMEOUT_S = 60.0
#: A waiting capture re-checks this often (a holder's thread may have exited).
_POLL_S = 0.05
#: A shared section that waited this long enters at the next capture end, ahead of
#: the next capture (and a waiting section re-checks the gate this often).
DEFAULT_FAIRNESS_S = 0.001


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


class CaptureGate(_GateWaiting):
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
        self._may_enter = threading.Condition(self._lock)
        self._may_capture = threading.Condition(self._lock)
        self._tls = threading.local()
        self._records = []
        if keep is not None:  # the thread that forked keeps its own open sections
            keep.aside = keep.granted = False
            keep.widening = _NOTHING
            keep.waiting = _NOT_WAITING
            keep.thread = weakref.ref(threading.current_thread())
            keep.name = threading.current_thread().name
            keep.thread_id = threading.get_ident()
            self._tls.rec = keep
            self._records.append(keep)
        self._owner = None
        self._guards = []
        self._harmful = frozenset()
        self._window = 0
        self._writers_waiting = 0
        self._closed = False
        self._deferred = []
        self._teardown = []
        self._generation = getattr(self, "_generation", 0) + 1
        self._retired_entered = 0
        self._contended = self._capture_waits = self._bypassed = self._admitted = 0
        self._capture_sleepers = 0
        self._captures = self._deferred_total = 0
        self._max_wait = 0.0
        self._bypassed_calls = Counter()

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
        try:
            rec = self._tls.rec
        except AttributeError:
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
                # Free at once, the common case, told without a call: no owner, and no
                # other thread in a section that blocks us or holding a grant. Stricter
                # than the wait's test (a dead thread's section or a stale grant counts
                # here), so it never takes what the wait would refuse; anything else,
                # the wait decides exactly. Free, nobody else can take the gate before
                # us (we hold the lock until we own it), so no capture needs waking.
                free = self._owner is None
                if free:
                    for other in self._records:
                        blocks = other.granted or (other.depth and not other.aside)
                        if blocks and other is not rec:
                            free = False
                            break
                if not free:
                    self._may_capture.notify_all()  # our own sections are set aside now
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
        # thread released our outer capture meanwhile, so this one is not nested. A
        # release meanwhile keeps the set widened (`rec.widening`, read by _release).
        widening = rec.widening
        rec.widening = _union(widening, harmful)
        self._harmful = _union(self._harmful, harmful)
        try:
            self._wait_until(
                lambda: self._owner is not rec or not self._running_admitted(rec), timeout, label
            )
        except BaseException:
            rec.widening = widening
            if self._owner is rec:
                self._harmful = _union(_union_all(g.harmful for g in self._guards), widening)
            raise
        rec.widening = widening
        if self._owner is not rec:
            return None
        guard = CaptureGuard(self, rec, harmful, label, site)
        self._guards += (guard,)
        made.append(guard)
        self._captures += 1
        return guard

    def owned_by_current_thread(self) -> bool:
        """True while this thread holds the exclusive side (a capture of its own is open)."""
        owner = self._owner
        return owner is not None and getattr(self._tls, "rec", None) is owner

    def _after_fork_in_child(self) -> None:
        keep = getattr(self._tls, "rec", None)
        self._init_state(keep)

    # The clock and poll period of every wait, read from this module at each use: the
    # model check sets `capsafe.gate.time` to a virtual clock, a test sets `_POLL_S`.
    def _now(self) -> float:
        return time.monotonic()

    def _poll_s(self) -> float:
        return _POLL_S


_NO_SECTION = "capture gate: exit() without a matching enter() on this thread"


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
