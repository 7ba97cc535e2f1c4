"""What a capture gate holds, shared by the modules that make up `capsafe.gate`.

The gate is one object whose roles live in their own modules (as trio keeps its
parking lot beside the primitives built on it): this one, the state and one record
per thread; `_gate_stats` the counters and holders; `_gate_release` the end of a
capture window and the teardown deferred to it; `_gate_waiting` the waits to enter
and to capture; `gate` the public API over them. Each role is a class the next one
derives from, so the whole gate stays one object with one lock, and no role reaches
past the ones below it.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capsafe.gate import CaptureGuard

# What a thread is waiting for inside the gate (`_Record.waiting`).
_NOT_WAITING, _SHARED_WAIT, _NESTED_WAIT, _CAPTURE_WAIT = 0, 1, 2, 3
_Deferred = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
_NOTHING: frozenset[str] = frozenset()


class _Record:
    """One thread's view of the gate. Only its own thread writes `depth` and `entered`.

    depth > 0: nested shared sections; depth < 0: sections the measured policy
    admitted beside an open capture (see `CaptureGate.enter`); 0: none.
    Written under the gate lock: `aside` marks a thread waiting for or holding
    the exclusive side (its shared sections do not block other captures);
    `waiting` what the thread waits for inside the gate; `granted` an entry
    ahead of the next capture, which counts only while the thread still waits;
    `widening` the harmful set of a nested capture the owner waits to begin (a release
    meanwhile must not narrow the gate's set below it).
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
        "widening",
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
        self.widening: frozenset[str] | None = _NOTHING  # a nested begin's set, while it waits
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


class _GateState:
    """The fields every role of the gate reads (set by `CaptureGate._init_state`).

    Declared here, once, so that each role's module is checked against them; the
    clock and poll period are `CaptureGate`'s, read from `capsafe.gate` at each use
    (the model check swaps that module's clock for a virtual one).
    """

    fairness_s: float
    shared_timeout: float | None
    _lock: threading.RLock
    _may_enter: threading.Condition  # shared sections wait here
    _may_capture: threading.Condition  # captures wait here
    _tls: threading.local
    _records: list[_Record]
    _owner: _Record | None
    _guards: list[CaptureGuard]
    _harmful: frozenset[str] | None
    _window: int  # bumped at every exclusive acquisition
    _writers_waiting: int
    _closed: bool  # a capture holds or waits for the exclusive side
    _deferred: list[_Deferred]
    _teardown: list[_Deferred]  # other threads' destroys, run at the window's end
    _generation: int
    _retired_entered: int
    _contended: int
    _capture_waits: int
    _capture_sleepers: int  # threads inside a capture's wait now (on `_may_capture`)
    _bypassed: int
    _admitted: int
    _captures: int
    _deferred_total: int
    _max_wait: float
    _bypassed_calls: Counter[str]
    _now: Callable[[], float]
    _poll_s: Callable[[], float]

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


def _union(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return None if a is None or b is None else a | b


def _union_all(sets: Iterator[frozenset[str] | None]) -> frozenset[str] | None:
    out: frozenset[str] | None = frozenset()
    for s in sets:
        out = _union(out, s)
    return out
