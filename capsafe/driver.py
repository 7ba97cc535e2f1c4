"""Choosing the backend and handing out the process-wide driver facade.

`CAPSAFE_BACKEND=cuda|sim|auto` selects. `auto` (the default) takes `cuda` when
a driver and at least one device answer, and `sim` otherwise, and logs which it
took and why, so a CPU-only CI run never mistakes itself for a GPU run.

`get()` hands out the backend behind a `GatedDriver`: every call the hazard
table says can break a capture takes the shared side of the process-wide
capture gate, capture begin/end take its exclusive side, and teardown that the
capturing thread requests mid-capture is deferred to the capture's end.
`CAPSAFE_GATE=0` (or `get(gated=False)`) keeps the facade but gates nothing,
only counting those calls so a broken capture can name them; `raw()` is the bare
backend, for A/B measurements.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from capsafe import _state, hazards
from capsafe.backend import Backend
from capsafe.config import BACKENDS, GATE_POLICIES, runtime_config
from capsafe.errors import BackendUnavailable, CaptureInvalidated, CudaError, UsageError
from capsafe.gate import DEFAULT_CAPTURE_TIMEOUT_S, CaptureGate, CaptureGuard
from capsafe.gate import gate as process_gate
from capsafe.handles import LEGACY_STREAM, CaptureMode, CaptureStatus, Graph, Stream, StreamKind
from capsafe.hazards.calls import (
    METHOD_CALLS,
    STREAM_WAIT_METHODS,
    STREAM_WORK_METHODS,
    hazard_call,
)

log = logging.getLogger("capsafe")

_lock = threading.Lock()
_driver: Backend | None = None
_facades: dict[bool, GatedDriver] = {}
_why = ""


def requested_backend() -> str:
    """The backend named by CAPSAFE_BACKEND (default auto), validated, from the frozen config."""
    return runtime_config().backend


def create_backend(name: str) -> tuple[Backend, str]:
    """A new backend of the named kind and a one-line reason for the choice.

    The simulated machine has CAPSAFE_SIM_DEVICES devices (default 1).
    """
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; use one of: {', '.join(BACKENDS)}")
    if name == "sim":
        from capsafe.sim import SimBackend

        return SimBackend(devices=runtime_config().sim_devices), "sim requested"
    from capsafe import backend_cuda

    problem = backend_cuda.unavailable_reason()
    if problem is None:
        return (
            backend_cuda.CudaBackend(),
            "cuda requested" if name == "cuda" else "auto: found a GPU",
        )
    if name == "cuda":
        raise BackendUnavailable(f"CAPSAFE_BACKEND=cuda but {problem}; use CAPSAFE_BACKEND=sim")
    from capsafe.sim import SimBackend

    devices = runtime_config().sim_devices
    return SimBackend(devices=devices), f"auto: {problem}, using the simulated device"


def raw() -> Backend:
    """The process-wide backend itself, created on first use from CAPSAFE_BACKEND: no gate."""
    global _driver, _why
    if _driver is None:
        with _lock:
            if _driver is None:
                backend, _why = create_backend(requested_backend())
                backend.init()
                log.info("capsafe backend: %s (%s)", backend.name, _why)
                _driver = backend
    return _driver


def get(gated: bool | None = None) -> Backend:
    """The process-wide driver facade; `gated` overrides CAPSAFE_GATE (see the module doc)."""
    config = runtime_config()
    key = config.gate_enabled if gated is None else gated
    facade = _facades.get(key)
    if facade is None:
        backend = raw()
        with _lock:
            facade = _facades.get(key)
            if facade is None:
                facade = GatedDriver(
                    backend, process_gate() if key else None, policy=config.gate_policy
                )
                _facades[key] = facade
    return cast(Backend, facade)


def backend_choice() -> str:
    """Which backend `get()` took and why, e.g. 'sim (auto: no NVIDIA driver ...)'."""
    driver = get()
    return f"{driver.name} ({_why})"


# -- the gated facade -----------------------------------------------------------

#: Teardown the capturing thread may trigger mid-capture (a finalizer): deferred to its end.
DEFERRED_RELEASES = frozenset(
    {
        "mem_free",
        "mem_free_host",
        "module_unload",
        "stream_destroy",
        "event_destroy",
        "primary_ctx_release",
    }
)
#: Teardown of finished graphs' executables, from any thread: while a capture holds or
#: waits for the gate it is queued and run when that window ends, never waited for (a
#: helper thread that ends captures for several capturer threads and destroys their
#: executables would otherwise wait for a capture only it can end). Measured on the H200:
#: cuGraphExecDestroy breaks a GLOBAL capture; cuGraphDestroy broke none (no gate at all).
QUEUED_TEARDOWN = frozenset({"graph_exec_destroy"})
_CAPTURE_METHODS = ("stream_begin_capture", "stream_end_capture")

#: Backend methods no hazard-table row covers that bypass the gate, and why each may.
NO_ROW_UNGATED: dict[str, str] = {
    "init": "cuInit: the backend is initialized before a facade exists; again it does nothing",
    "driver_version": "host-side query, no device work",
    "device_get_count": "host-side query, no device work",
    "device_get": "host-side query, no device work",
    "device_get_name": "host-side query, no device work",
    "device_get_attribute": "host-side query, no device work",
    "mem_get_allocation_granularity": "host-side query, no device work",
    "ctx_set_current": "binds this thread's context: per-thread state, no device work",
    "ctx_get_current": "reads this thread's context: per-thread state, no device work",
    "module_get_function": "symbol lookup in a loaded module, no device work",
    "stream_is_capturing": (
        "every measured hazard-matrix cell calls it inside the open capture "
        "(the capturing_after column) and the table matched every row"
    ),
}
#: Backend methods no row covers whose effect on another thread's capture was never
#: measured: gated, unnamed, so even the measured policy keeps them out of every window.
NO_ROW_GATED: dict[str, str] = {
    "event_query": "cuEventQuery on an event of the capturing stream is illegal mid-capture",
    "graph_instantiate": "not in the hazard matrix",
}


class Gating(enum.Enum):
    """How the facade treats one Backend method."""

    GATED = "gated"  # the shared side, named by `call` (None: unnamed, conservative)
    BY_STREAM = "gated by stream"  # the shared side when its stream makes it breaking
    CAPTURE = "capture begin/end"  # the exclusive side
    UNGATED = "never capture-breaking"  # the backend's own bound method


@dataclass(frozen=True)
class Classification:
    gating: Gating
    call: str | None  # the hazard-table row the gate names the call by
    evidence: str  # the row, or why no row applies


def classify(method: str) -> Classification:
    """How the facade gates `method`; a method nobody classified is gated, unnamed.

    That default keeps the facade closed: `tests/core/test_facade.py` fails while any
    Backend method still falls to it.
    """
    row = METHOD_CALLS.get(method)
    if method in _CAPTURE_METHODS:
        return Classification(Gating.CAPTURE, None, "takes the exclusive side")
    if method in STREAM_WAIT_METHODS:
        # The stream may be the capturing one: named by that, its worst case.
        evidence = "row stream_query_capturing (on the capturing stream)"
        return Classification(Gating.GATED, "stream_query_capturing", evidence)
    if method in STREAM_WORK_METHODS:
        evidence = "rows memset_async_legacy / mem_alloc_async_other, by its stream"
        return Classification(Gating.BY_STREAM, None, evidence)
    if row is not None and row in hazards.CAPTURE_BREAKING_CALLS:
        return Classification(Gating.GATED, row, f"row {row}")
    if row is not None:
        return Classification(Gating.UNGATED, row, f"row {row}: breaks no measured cell")
    if method in NO_ROW_UNGATED:
        return Classification(Gating.UNGATED, None, NO_ROW_UNGATED[method])
    if method in NO_ROW_GATED:
        return Classification(Gating.GATED, None, NO_ROW_GATED[method])
    return Classification(Gating.GATED, None, "unclassified: gated by default")


def _stream_index(method: str) -> int:
    """Position of the `stream` argument of a Backend method (self not counted)."""
    params = list(inspect.signature(getattr(Backend, method)).parameters)
    return params.index("stream") - 1


def _breaking(call: str | None) -> str | None:
    return call if call in hazards.CAPTURE_BREAKING_CALLS else None


@functools.cache
def breaking_calls(mode: CaptureMode, stream_kind: StreamKind) -> frozenset[str]:
    """Calls that break a `mode` capture on a `stream_kind` stream from another thread.

    The gate is process-wide and does not know which device a call runs on, so
    this is every device relation's set (the cross-device rows are predictions).
    """
    return frozenset(
        c
        for c in hazards.CALLS
        for device in hazards.DEVICES
        if hazards.rule_for(c, mode, stream_kind, hazards.OTHER_THREAD, device)
    )


class _Activity:
    """Hazardous calls made through the ungated facade, counted per thread without a lock."""

    def __init__(self) -> None:
        self._tls = threading.local()
        self._counters: list[tuple[threading.Thread, Counter[str]]] = []

    def count(self, call: str) -> None:
        try:
            counter = self._tls.counter
        except AttributeError:
            counter = self._tls.counter = Counter()
            self._counters.append((threading.current_thread(), counter))
        counter[call] += 1

    def snapshot(self) -> Counter[tuple[str, str]]:
        out: Counter[tuple[str, str]] = Counter()
        for thread, counter in list(self._counters):
            for call, n in dict(counter).items():
                out[thread.name, call] += n
        return out


@dataclass
class _Window:
    """One open capture as the facade saw it begin."""

    stream: Stream
    mode: CaptureMode
    started: float
    guard: CaptureGuard | None
    activity: Counter[tuple[str, str]]
    bypassed: Counter[str]


class GatedDriver:
    """A `Backend` with the capture gate in front of the calls that can break a capture.

    Methods are bound per instance when the facade is built: calls the hazard
    table never flags are the backend's own bound methods (no overhead), flagged
    calls are wrapped in one shared section, releases first check for a capture
    of the calling thread. `gate=None` builds the ungated facade, which only
    counts the flagged calls. `policy`: "conservative" keeps every flagged call
    out of every capture window; "measured" lets a call run beside an open capture
    whose mode and stream kind it cannot break (see docs/gate.md).
    """

    def __init__(
        self,
        backend: Backend,
        gate: CaptureGate | None,
        *,
        policy: str = "conservative",
        capture_timeout: float | None = DEFAULT_CAPTURE_TIMEOUT_S,
    ) -> None:
        if policy not in GATE_POLICIES:
            raise UsageError(
                f"unknown gate policy {policy!r}; use one of: {', '.join(GATE_POLICIES)}"
            )
        self.backend = backend
        self.gate = gate
        self.policy = policy
        self.capture_timeout = capture_timeout
        self.name = backend.name
        self.activity = _Activity()
        self._windows: dict[int, _Window] = {}
        for method in Backend.__abstractmethods__:
            if method not in _CAPTURE_METHODS:
                setattr(self, method, self._bind(method))

    @property
    def gated(self) -> bool:
        return self.gate is not None

    def __getattr__(self, name: str) -> Any:
        # Only Backend methods are bound (each classified); nothing else passes through.
        raise AttributeError(
            f"the gated driver has no {name!r}: it offers exactly the methods of "
            "capsafe.backend.Backend, each classified for the capture gate"
        )

    def _bind(self, method: str) -> Callable[..., Any]:
        fn = getattr(self.backend, method)
        how = classify(method)
        if how.gating is Gating.BY_STREAM:
            # Work on another stream: only whether it is the legacy stream matters, so
            # both answers are settled here, not on every call.
            index = _stream_index(method)
            legacy = _breaking(hazard_call(method, LEGACY_STREAM))
            other = _breaking(hazard_call(method, Stream(LEGACY_STREAM.value + 1)))  # any other

            def by_stream(*args: Any, **kwargs: Any) -> str | None:
                stream = args[index] if len(args) > index else kwargs["stream"]
                return legacy if stream is None or stream.value == LEGACY_STREAM.value else other

            wrapped = self._wrap(fn, by_stream)
        elif how.gating is Gating.GATED:
            wrapped = self._wrap(fn, None, how.call)
        else:
            wrapped = fn
        if method in DEFERRED_RELEASES and self.gate is not None:
            wrapped = self._deferring(wrapped, self.gate)
        elif method in QUEUED_TEARDOWN and self.gate is not None:
            wrapped = self._queued(fn, wrapped, self.gate)
        return functools.wraps(fn)(wrapped) if wrapped is not fn else fn

    def _wrap(
        self,
        fn: Callable[..., Any],
        classify: Callable[..., str | None] | None,
        fixed: str | None = None,
    ) -> Callable[..., Any]:
        gate = self.gate
        if gate is None:
            count = self.activity.count

            def counted(*args: Any, **kwargs: Any) -> Any:
                call = fixed if classify is None else classify(*args, **kwargs)
                if call is not None:
                    count(call)
                return fn(*args, **kwargs)

            return counted
        if classify is None:
            return gate.wrap(fn, fixed)
        return gate.wrap(fn, classify=classify)

    @staticmethod
    def _deferring(release: Callable[..., Any], gate: CaptureGate) -> Callable[..., Any]:
        defer = gate.defer_if_capturing

        def deferring(*args: Any, **kwargs: Any) -> Any:
            if defer(release, *args, **kwargs):
                return None
            return release(*args, **kwargs)

        return deferring

    @staticmethod
    def _queued(
        raw: Callable[..., Any], gated: Callable[..., Any], gate: CaptureGate
    ) -> Callable[..., Any]:
        # Queued calls run raw: the gate runs them while no capture can begin beside them.
        defer = gate.defer_while_closed

        def queued(*args: Any, **kwargs: Any) -> Any:
            if defer(raw, *args, **kwargs):
                return None
            return gated(*args, **kwargs)

        return queued

    # -- capture -------------------------------------------------------------------
    # Both halves of every pair (guard registered + window recorded, window recorded +
    # capture begun) are made so that an exception landing anywhere between them (a
    # signal: CPython raises it at a call) is caught, the pair made whole or undone,
    # and the exception raised on: begin is all or nothing, a running end finishes.
    def stream_begin_capture(self, stream: Stream, mode: CaptureMode | str) -> None:
        """Take the gate's exclusive side (if gated), then begin capturing `stream`.

        When it raises, no capture is open and nothing is held.
        """
        mode = CaptureMode.parse(mode)
        made: list[CaptureGuard] = []  # the guard, appended as the gate registers it
        window: _Window | None = None
        calling = False
        try:
            if self.gate is not None:
                harmful = (
                    None if self.policy == "conservative" else breaking_calls(mode, stream.kind)
                )
                self.gate.begin_capture(
                    harmful=harmful,
                    timeout=self.capture_timeout,
                    label=f"on stream {stream.value} ({stream.kind}, {mode})",
                    into=made,
                )
            window = _Window(
                stream,
                mode,
                time.monotonic(),
                made[0] if made else None,
                self.activity.snapshot() if self.gate is None else Counter(),
                Counter() if self.gate is None else self.gate.bypassed_calls(),
            )
            # Recorded before the driver begins, so an end always finds the guard (a
            # stream with a window already is capturing: the driver will refuse).
            early = stream.value not in self._windows
            if early:
                self._windows[stream.value] = window
            calling = True
            self.backend.stream_begin_capture(stream, mode)
            if not early:
                self._windows[stream.value] = window
        except BaseException as exc:
            self._undo_begin(stream, window, made, calling and not isinstance(exc, CudaError))
            raise

    def _undo_begin(
        self,
        stream: Stream,
        window: _Window | None,
        made: list[CaptureGuard],
        may_have_begun: bool,
    ) -> None:
        try:
            if window is not None and self._windows.get(stream.value) is window:
                del self._windows[stream.value]
            if may_have_begun and self._still_capturing(stream):
                # The driver began before the exception landed: end it, nothing is captured.
                with contextlib.suppress(CudaError):
                    self.backend.graph_destroy(self.backend.stream_end_capture(stream))
        finally:
            for guard in made:
                guard.release()

    def stream_end_capture(self, stream: Stream) -> Graph:
        """End the capture and release the gate (running deferred teardown); see `capture`.

        When the driver refuses to end it (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
        the capture is still open, so the gate stays held until it really ends. When
        anything else (a signal) interrupts it before the driver ended the capture, it
        is ended here (its graph discarded) and the gate released before that raises.
        """
        window = self._windows.get(stream.value)
        try:
            graph = self.backend.stream_end_capture(stream)
        except BaseException as exc:
            if window is not None and self._still_capturing(stream):
                if isinstance(exc, CudaError):
                    raise  # the driver refused: still open, the gate stays held
                with contextlib.suppress(CudaError):
                    self.backend.graph_destroy(self.backend.stream_end_capture(stream))
                if self._still_capturing(stream):
                    raise  # cannot end it from here: still open, still held
            try:
                self._close(stream, window)
            except BaseException:
                self._close(stream, window)
                raise
            if isinstance(exc, CaptureInvalidated) and window is not None:
                raise CaptureInvalidated(exc.result, exc.call, self._explain(window)) from exc
            raise
        try:
            self._close(stream, window)
        except BaseException:
            self._close(stream, window)  # a signal at its entry: it did nothing yet
            raise
        return graph

    def _close(self, stream: Stream, window: _Window | None) -> None:
        """Forget the window and release its guard; again does nothing."""
        if window is None:
            return
        if self._windows.get(stream.value) is window:
            del self._windows[stream.value]
        if window.guard is not None:
            window.guard.release()

    def _still_capturing(self, stream: Stream) -> bool:
        try:
            return self.backend.stream_is_capturing(stream) is not CaptureStatus.NONE
        except CudaError:  # the stream is gone or broken: nothing left to protect
            return False

    def _explain(self, window: _Window) -> str:
        seconds = time.monotonic() - window.started
        text = (
            f"capture on stream {window.stream.value} ({window.stream.kind}), "
            f"mode {window.mode}, open {seconds * 1e3:.3f} ms"
        )
        if self.gate is None:
            seen = self.activity.snapshot() - window.activity
            calls = ", ".join(
                f"{call} x{n} on {thread!r}" for (thread, call), n in seen.most_common(8)
            )
            return (
                f"{text}; the gate is off; capture-breaking calls made through the ungated "
                f"facade during the window: {calls or 'none seen'}"
            )
        own = self.gate.bypassed_calls() - window.bypassed
        calls = ", ".join(f"{call} x{n}" for call, n in own.most_common(8))
        return (
            f"{text}; the gate was held ({self.policy} policy), so no gated call ran on "
            f"another thread; calls the capturing thread made itself: {calls or 'none'}; "
            "calls through driver.raw() or other libraries are not observed"
        )


Backend.register(GatedDriver)  # methods are bound per instance; see GatedDriver.__init__


@_state.on_reset
def _reset(forked: bool) -> None:
    # A forked child starts with no driver (a CUDA context does not survive fork).
    global _lock, _driver, _facades, _why
    if forked:
        _lock = threading.Lock()
    _driver = None
    _facades = {}
    _why = ""


def _adopt(backend: Backend, why: str) -> None:
    """Make `backend` the process-wide one (`_state.reset_for_tests` only)."""
    global _driver, _why
    with _lock:
        _driver, _why = backend, why
