"""Capture windows a framework opens itself, held on the gate's exclusive side.

A framework's begin call (`Stream.begin_capture`, `GraphBuilder.begin_building`)
takes the exclusive side first; the guard is stored under the framework's key
for that capture (a stream pointer, a builder) and released by the matching end
call, also when the end call raises. Teardown the capturing thread asks for in
between is deferred by the gate to the release, as for `capsafe.capture`.

Signals: the guard is recorded under its key as the gate registers it, and under
the key before the framework begins, so an end always finds it; a begin that
raises (a signal anywhere inside, or right after it returned: see
`errors.raised_here`) has ended whatever it began and released its guard. A
begin in flight is known by thread, so `uninstall()` can refuse while one runs
and `release_all()` releases its guard too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from contextlib import suppress
from functools import partial
from threading import get_ident
from typing import Any, TypeVar

from capsafe.backend import Backend
from capsafe.driver import GatedDriver, breaking_calls
from capsafe.gate import CaptureGate, CaptureGuard
from capsafe.handles import CaptureMode, StreamKind

log = logging.getLogger("capsafe")
T = TypeVar("T")


def gate_of(driver: Backend) -> CaptureGate | None:
    """The gate behind a facade from `capsafe.driver.get()`; None when it gates nothing."""
    return driver.gate if isinstance(driver, GatedDriver) else None


def exclusive(
    driver: Backend,
    mode: CaptureMode,
    kind: Callable[[], StreamKind],
    label: str,
    into: list[CaptureGuard],
) -> None:
    """Take the exclusive side for one window as `driver.stream_begin_capture` would.

    The guard is appended to `into` as the gate registers it (nothing when `driver`
    gates nothing). `kind` is only called under the measured policy (it may cost a
    driver query).
    """
    if not isinstance(driver, GatedDriver) or driver.gate is None:
        return
    harmful = None if driver.policy == "conservative" else breaking_calls(mode, kind())
    driver.gate.begin_capture(
        harmful=harmful, label=label, timeout=driver.capture_timeout, into=into
    )


def _safely(still_active: Callable[[], bool]) -> bool:
    try:
        return still_active()
    except Exception:  # an invalidated or broken capture: nothing left to protect
        return False


def _thread(ident: int) -> threading.Thread:
    """The thread of `ident` (a begin in flight records the ident: no Python call)."""
    found = {thread.ident: thread for thread in threading.enumerate()}.get(ident)
    if found is not None:
        return found
    return threading.Thread(name=f"thread {ident} (exited)")  # named for the message only


class Windows:
    """Open windows by key. Thread-safe: a capture may end on another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Hashable, CaptureGuard] = {}
        # Begins in flight: id of their guard list -> (thread ident, guard list).
        self._beginning: dict[int, tuple[int, list[CaptureGuard]]] = {}
        self.hooked = False  # the framework's methods are replaced (install() .. uninstall())
        self.opened = 0  # windows begun so far: tells one window from the next

    def __len__(self) -> int:
        return len(self._open)

    def begin(
        self,
        key: Hashable,
        take: Callable[[list[CaptureGuard]], None],
        begin: Callable[[], T],
        abort: Callable[[], object],
        still_active: Callable[[], bool],
        *,
        hooked: bool = False,
    ) -> T:
        """Take the guard (`take` appends it), record it under `key`, run the framework's begin.

        `hooked`: called through a replaced method, which `uninstall()` may have put
        back meanwhile; then the framework's begin runs alone, as after uninstall.
        When this raises, `abort()` has ended a capture that `still_active()` says
        began, and the guard is released.
        """
        made: list[CaptureGuard] = []
        token = id(made)
        calling = False
        try:
            with self._lock:
                alone = hooked and not self.hooked  # uninstalled while on its way in
                if not alone:
                    self._beginning[token] = (threading.get_ident(), made)
            if alone:
                return begin()
            take(made)
            if made:  # recorded before the framework begins, unless the key is in use
                with self._lock:
                    early = key not in self._open
                    if early:
                        self._open[key] = made[0]
            calling = True
            result = begin()
            if made:
                self._record(key, made[0], early)
            self._beginning.pop(token, None)  # inside the try: a signal after it undoes all
        except BaseException as exc:
            self._beginning.pop(token, None)
            # An Exception from the framework's begin is a refusal: nothing began.
            began = calling and not isinstance(exc, Exception)
            self._undo(key, made, abort, still_active if began else None)
            raise
        return result

    def begin_hooked(
        self,
        key: Any,
        gate: CaptureGate | None,
        harmful: frozenset[str] | None,
        label: str,
        timeout: float | None,
        begin: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        abort: Callable[[Any], object],
        still_active: Callable[[], bool],
    ) -> T:
        """`begin` for a replaced method: as `begin(key, take, ...)`, with the exclusive side
        taken from `gate` itself (None: it gates nothing) and `begin(key, *args, **kwargs)`
        the framework's begin, `abort(key)` its end.

        The same steps and the same undo as `begin`, with no Python call of its own but
        the gate's and the framework's and no object made per capture but the guard list:
        every capture of a hooked framework comes here (a protected `torch.cuda.graph`
        spent more in this bookkeeping than in the gate).
        """
        made: list[CaptureGuard] = []
        token = id(made)
        calling = False
        try:
            with self._lock:
                alone = not self.hooked  # uninstalled while on its way in
                if not alone:
                    self._beginning[token] = (get_ident(), made)
            if alone:
                return begin(key, *args, **kwargs)
            if gate is not None:
                gate.begin_capture(harmful=harmful, label=label, timeout=timeout, into=made)
            if made:  # recorded before the framework begins, unless the key is in use
                early = self._open.setdefault(key, made[0]) is made[0]  # one atomic step
            calling = True
            result = begin(key, *args, **kwargs)
            stale = None
            if made:
                with self._lock:
                    if not early:
                        stale = self._open.get(key)
                    self._open[key] = made[0]
                    self.opened += 1
            self._beginning.pop(token, None)  # inside the try: a signal after it undoes all
            if stale is not None and stale is not made[0]:
                stale.release()  # the framework reused a key whose end we never saw
        except BaseException as exc:
            self._beginning.pop(token, None)
            # An Exception from the framework's begin is a refusal: nothing began.
            began = calling and not isinstance(exc, Exception)
            self._undo(key, made, partial(abort, key), still_active if began else None)
            raise
        return result

    def _record(self, key: Hashable, guard: CaptureGuard, early: bool) -> None:
        with self._lock:
            stale = None if early else self._open.get(key)
            self._open[key] = guard
            self.opened += 1
        if stale is not None and stale is not guard:
            stale.release()  # the framework reused a key whose end we never saw

    def _undo(
        self,
        key: Hashable,
        made: list[CaptureGuard],
        abort: Callable[[], object],
        still_active: Callable[[], bool] | None,
    ) -> None:
        try:
            with self._lock:
                if made and self._open.get(key) is made[0]:
                    del self._open[key]
            if made and still_active is not None and _safely(still_active):
                with suppress(Exception):  # began before the exception landed: end it
                    abort()
        finally:
            for guard in made:
                guard.release()

    def undo_begin(
        self, key: Hashable, abort: Callable[[], object], still_active: Callable[[], bool]
    ) -> None:
        """Undo a begin that returned but whose caller was interrupted before returning it."""
        with self._lock:
            guard = self._open.get(key)
        self._undo(key, [guard] if guard is not None else [], abort, still_active)

    def end(
        self,
        key: Hashable,
        end: Callable[..., T],
        still_active: Callable[[], bool] | None = None,
        args: tuple[Any, ...] | None = None,
    ) -> T:
        """Run the framework's end call (`end()`, or `end(*args)`), then release the key's guard.

        Also when the end call raises, unless `still_active()` says the capture is
        still open and intact (the driver refused to end it, e.g. from the wrong
        thread): then the guard stays, for the end call that really ends it. A
        signal (an exception that is not an `Exception`) before the framework's end
        ran is followed by that end, so the capture ends and the guard goes back.
        """
        taken = self._open.get(key)
        try:
            result = end() if args is None else end(*args)
        except BaseException as exc:
            # A signal that landed before the framework ended it: end it now.
            if (
                not isinstance(exc, Exception)
                and still_active is not None
                and _safely(still_active)
            ):
                with suppress(Exception):
                    end() if args is None else end(*args)
            if taken is not None and still_active is not None and _safely(still_active):
                raise  # still open: the guard stays for the end call that ends it
            try:
                self._forget(key, taken)
            except BaseException:
                self._forget(key, taken)  # an exception at its entry: it did nothing yet
                raise
            raise
        if taken is None:
            return result
        try:  # _forget inline: one Python call fewer per window
            with self._lock:
                if self._open.get(key) is taken:
                    del self._open[key]
            taken.release()
        except BaseException:
            self._forget(key, taken)  # a signal before the release did anything: it does it
            raise
        return result

    def finish(
        self, key: Hashable, end: Callable[[], object], still_active: Callable[[], bool]
    ) -> None:
        """After an end call that a signal interrupted: end the capture if it is still open,
        and release its guard (nothing when the end got that far)."""
        taken = self._open.get(key)
        if taken is None:
            return
        if _safely(still_active):
            with suppress(Exception):
                end()
        if not _safely(still_active):
            self._forget(key, taken)

    def _forget(self, key: Hashable, taken: CaptureGuard | None) -> None:
        # Drop the key's guard and release it; a second call does nothing.
        if taken is None:
            return
        with self._lock:
            if self._open.get(key) is taken:
                del self._open[key]
        taken.release()

    def in_flight(self) -> list[threading.Thread]:
        """Threads inside a begin right now."""
        with self._lock:
            idents = [ident for ident, _ in self._beginning.values()]
        return [_thread(ident) for ident in idents]

    def unhook(self, still_open: str = "capture(s) still open") -> None:
        """Stop hooked begins from taking the gate; refused while a window is open or begins.

        Raises RuntimeError naming the thread in a begin, or counting the open windows
        (`still_open` words them), for the integration to word.
        """
        with self._lock:
            busy = [ident for ident, _ in self._beginning.values()]
            if busy:
                name = _thread(busy[0]).name
                raise RuntimeError(f"thread {name!r} is inside a hooked begin")
            if self._open:
                raise RuntimeError(f"{len(self._open)} {still_open}")
            self.hooked = False

    def release_all(self) -> list[str]:
        """Release every guard still held (unended captures, begins in flight); their labels."""
        with self._lock:
            left, self._open = list(self._open.values()), {}
            for _, made in self._beginning.values():
                left.extend(g for g in made if g not in left)
        labels = []
        for guard in left:
            if guard.released:
                continue
            log.warning("capsafe: releasing the gate held by an unended capture %s", guard.label)
            guard.release()
            labels.append(guard.label)
        return labels
