"""One cell of the hazard matrix, measured the same way on any backend.

`run_trial` opens a capture, makes one row's call from `capsafe.hazards.actions`
(on the capturing thread or another one) and ends the capture, recording what
the call and cuStreamEndCapture returned. For a cross-device cell
(`hazards.OTHER_DEVICE`) the capture is on device 0 and the call is made with
device 1's primary context current, on resources of device 1. For a left-open cell
(`hazards.LEFT_OPEN`) another thread's cuCtxSynchronize first invalidates the
capture, which is then left open while the call is made. The simulated
device is tested with this code and the real driver measured with it, so both
see the very same calls. Only the hazard-matrix reproducer and the tests import
this module; the driver facade does not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.errors import CudaError, UsageError
from capsafe.handles import (
    CaptureMode,
    CaptureStatus,
    Context,
    Device,
    DevicePtr,
    Stream,
    StreamKind,
)
from capsafe.hazards.actions import BUFFER_BYTES, BY_ROW, ActionKit, HazardAction, Leftover

#: (capturing device, calling device) ordinals of each device relation.
ORDINALS: dict[str, tuple[int, int]] = {hazards.SAME_DEVICE: (0, 0), hazards.OTHER_DEVICE: (0, 1)}


def devices_needed(device: str) -> int:
    """How many devices a cell of this device relation needs."""
    return max(ORDINALS[device]) + 1


def needs_devices_message(device: str, count: int) -> str:
    """The one line a machine with too few devices gets, or '' when it has enough."""
    need = devices_needed(device)
    return "" if count >= need else f"needs {need} devices, this machine has {count}"


@dataclass(frozen=True)
class TrialResult:
    """One measured cell; field names match the hazard-matrix JSON rows."""

    call: str
    mode: str
    stream: str
    caller: str
    device: str
    state: str
    call_result: str
    capturing_after: str
    end_capture: str

    @property
    def outcome(self) -> hazards.Outcome:
        return hazards.Outcome(self.call_result, self.end_capture)


@dataclass(frozen=True)
class _Sides:
    """The capture's side (device A) and the call's side (device B; A for same-device cells)."""

    capture_context: Context
    call_context: Context
    capture_ptr: DevicePtr  # what the capture records a fill of: a non-empty graph

    @property
    def crossed(self) -> bool:
        """True for a cross-device cell: the calling thread switches contexts around the call."""
        return self.call_context != self.capture_context

    def bind_call(self, b: Backend) -> None:
        if self.crossed:
            b.ctx_set_current(self.call_context)

    def bind_capture(self, b: Backend) -> None:
        if self.crossed:
            b.ctx_set_current(self.capture_context)


def _result_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except CudaError as exc:
        return exc.result
    return hazards.SUCCESS


def _retained(b: Backend, device: Device, stack: contextlib.ExitStack) -> Context:
    """Two references to `device`'s primary context, released when `stack` closes."""
    context = b.primary_ctx_retain(device)
    stack.callback(b.primary_ctx_release, device)
    b.primary_ctx_retain(device)  # the trial's own reference (see run_trial)
    stack.callback(b.primary_ctx_release, device)
    return context


def _best_effort(b: Backend, context: Context, fn: Callable[..., Any], *args: Any) -> None:
    """Cleanup in `context`; a failure is dropped (the verdict is already taken)."""
    with contextlib.suppress(CudaError):
        b.ctx_set_current(context)
        fn(*args)


def run_trial(
    backend: Backend,
    call: str,
    mode: CaptureMode | str,
    stream_kind: StreamKind | str,
    caller: str,
    device: str = hazards.SAME_DEVICE,
    state: str = hazards.ACTIVE,
    *,
    timeout: float = 30.0,
) -> TrialResult:
    """Measure one cell: capture on a `stream_kind` stream, make `call`, end the capture.

    In the LEFT_OPEN `state` another thread's cuCtxSynchronize invalidates the capture
    first (as the H200 probe of 2026-12-01 did); a breaker that does not leave it
    INVALIDATED is a RuntimeError, since the cell could not be set up.

    `backend` must be initialized; the calling thread becomes the capturing
    thread. For OTHER_THREAD the call runs on a fresh thread that binds the
    call's context first. A call that does not return within `timeout` seconds
    raises TimeoutError (a hang is a finding, not a result). The trial holds its
    own primary-context references, so `primary_ctx_release_retain` never drops
    the refcount to zero (which would tear the context down). A cross-device
    cell on a machine with one device is a UsageError.
    """
    action = BY_ROW[call]
    mode, stream_kind = CaptureMode.parse(mode), StreamKind(stream_kind)
    if caller not in hazards.CALLERS:
        raise UsageError(f"unknown caller {caller!r}; use one of: {', '.join(hazards.CALLERS)}")
    if device not in hazards.DEVICES:
        raise UsageError(f"unknown device {device!r}; use one of: {', '.join(hazards.DEVICES)}")
    if state not in hazards.STATES:
        raise UsageError(f"unknown state {state!r}; use one of: {', '.join(hazards.STATES)}")
    b = backend
    if problem := needs_devices_message(device, b.device_get_count()):
        raise UsageError(f"this {device} trial {problem}")
    capture_device, call_device = (b.device_get(n) for n in ORDINALS[device])
    with contextlib.ExitStack() as stack:
        capture_context = _retained(b, capture_device, stack)
        same = device == hazards.SAME_DEVICE
        call_context = capture_context if same else _retained(b, call_device, stack)
        stack.callback(b.ctx_set_current, b.ctx_get_current())  # runs before the releases
        b.ctx_set_current(capture_context)
        stream = b.stream_create(nonblocking=stream_kind is StreamKind.NONBLOCKING)
        stack.callback(_best_effort, b, capture_context, b.stream_destroy, stream)
        if not same:
            capture_ptr = b.mem_alloc(BUFFER_BYTES)
            stack.callback(_best_effort, b, capture_context, b.mem_free, capture_ptr)
            b.ctx_set_current(call_context)
        kit = ActionKit(b, capturing=stream, device=call_device)
        stack.callback(_best_effort, b, call_context, kit.close)
        sides = _Sides(capture_context, call_context, kit.ptr if same else capture_ptr)
        call_result, status, end_capture = _measure(
            b, kit, sides, action, mode, caller, state, timeout
        )
    return TrialResult(
        call,
        mode.value,
        stream_kind.value,
        caller,
        device,
        state,
        call_result,
        status.value,
        end_capture,
    )


def _measure(
    b: Backend,
    kit: ActionKit,
    sides: _Sides,
    action: HazardAction,
    mode: CaptureMode,
    caller: str,
    state: str,
    timeout: float,
) -> tuple[str, CaptureStatus, str]:
    """Prepare on the call's side, capture on the capture's side, (for LEFT_OPEN, break
    the capture from another thread), call, end the capture.

    Entered with the call's context current; leaves the capture's current.
    """
    stream = kit.capturing
    assert stream is not None
    prepared = action.prepare(kit) if action.prepare is not None else None
    box: list[Leftover] = [prepared]  # what cleanup must release: the prepared thing until used

    def perform() -> None:
        box[0] = action.perform(kit, prepared)

    try:
        b.ctx_synchronize()
        if sides.crossed:
            sides.bind_capture(b)
            b.ctx_synchronize()
        b.stream_begin_capture(stream, mode)
        b.memset_d8_async(sides.capture_ptr, 1, BUFFER_BYTES, stream)  # a non-empty graph
        if state == hazards.LEFT_OPEN:
            _leave_invalidated(b, sides.capture_context, stream, timeout)
        if caller == hazards.SAME_THREAD:
            sides.bind_call(b)
            try:
                call_result = _result_of(perform)
            finally:
                sides.bind_capture(b)
        else:
            call_result = _on_other_thread(b, sides.call_context, perform, timeout)
        status = b.stream_is_capturing(stream)
        end_capture = _result_of(lambda: b.graph_destroy(b.stream_end_capture(stream)))
        if b.stream_is_capturing(stream) is not CaptureStatus.NONE:
            raise RuntimeError(f"{action.row}: the capture stayed open after stream_end_capture")
    finally:
        if box[0] is not None:
            kit.leftovers.append(box[0])
    return call_result, status, end_capture


def _leave_invalidated(b: Backend, context: Context, stream: Stream, timeout: float) -> None:
    """Another thread's cuCtxSynchronize breaks the open capture, which stays open."""
    breaker = _on_other_thread(b, context, b.ctx_synchronize, timeout)
    status = b.stream_is_capturing(stream)
    if status is not CaptureStatus.INVALIDATED:
        raise RuntimeError(
            f"a left-open cell needs an invalidated capture, but another thread's "
            f"cuCtxSynchronize returned {breaker} and left it {status.value}"
        )


def _on_other_thread(b: Backend, context: Context, fn: Callable[[], Any], timeout: float) -> str:
    box: list[str | BaseException] = []

    def body() -> None:
        try:
            b.ctx_set_current(context)
            box.append(_result_of(fn))
        except BaseException as exc:  # handed to the capturing thread below
            box.append(exc)

    thread = threading.Thread(target=body, name="capsafe-hazard-caller", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the other-thread call did not return within {timeout} s")
    (result,) = box
    if isinstance(result, BaseException):
        raise result
    return result
