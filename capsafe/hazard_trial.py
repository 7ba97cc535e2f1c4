"""One cell of the hazard matrix, measured the same way on any backend.

`run_trial` opens a capture, makes one row's call from `capsafe.hazard_actions`
(on the capturing thread or another one) and ends the capture, recording what
the call and cuStreamEndCapture returned. The simulated device is tested with
this code and the real driver measured with it, so both see the very same
calls. Only the hazard-matrix reproducer and the tests import this module; the
driver facade does not.
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
from capsafe.handles import CaptureMode, CaptureStatus, Context, StreamKind
from capsafe.hazard_actions import BUFFER_BYTES, BY_ROW, ActionKit, HazardAction, Leftover


@dataclass(frozen=True)
class TrialResult:
    """One measured cell; field names match the hazard-matrix JSON rows."""

    call: str
    mode: str
    stream: str
    caller: str
    call_result: str
    capturing_after: str
    end_capture: str

    @property
    def outcome(self) -> hazards.Outcome:
        return hazards.Outcome(self.call_result, self.end_capture)


def _result_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except CudaError as exc:
        return exc.result
    return hazards.SUCCESS


def run_trial(
    backend: Backend,
    call: str,
    mode: CaptureMode | str,
    stream_kind: StreamKind | str,
    caller: str,
    *,
    timeout: float = 30.0,
) -> TrialResult:
    """Measure one cell: capture on a `stream_kind` stream, make `call`, end the capture.

    `backend` must be initialized; the calling thread becomes the capturing
    thread. For OTHER_THREAD the call runs on a fresh thread that binds the same
    context first. A call that does not return within `timeout` seconds raises
    TimeoutError (a hang is a finding, not a result). The trial holds its own
    primary-context reference, so `primary_ctx_release_retain` never drops the
    refcount to zero (which would tear the context down).
    """
    action = BY_ROW[call]
    mode, stream_kind = CaptureMode.parse(mode), StreamKind(stream_kind)
    if caller not in hazards.CALLERS:
        raise UsageError(f"unknown caller {caller!r}; use one of: {', '.join(hazards.CALLERS)}")
    b = backend
    device = b.device_get(0)
    context = b.primary_ctx_retain(device)
    b.primary_ctx_retain(device)  # the trial's own reference (see above)
    previous = b.ctx_get_current()
    b.ctx_set_current(context)
    try:
        stream = b.stream_create(nonblocking=stream_kind is StreamKind.NONBLOCKING)
        try:
            kit = ActionKit(b, capturing=stream, device=device)
            try:
                result = _measure(b, kit, context, action, mode, caller, timeout)
            finally:
                with contextlib.suppress(CudaError):  # best effort: the verdict is taken
                    kit.close()
        finally:
            with contextlib.suppress(CudaError):
                b.stream_destroy(stream)
    finally:
        b.ctx_set_current(previous)
        b.primary_ctx_release(device)
        b.primary_ctx_release(device)
    call_result, status, end_capture = result
    return TrialResult(
        call, mode.value, stream_kind.value, caller, call_result, status.value, end_capture
    )


def _measure(
    b: Backend,
    kit: ActionKit,
    context: Context,
    action: HazardAction,
    mode: CaptureMode,
    caller: str,
    timeout: float,
) -> tuple[str, CaptureStatus, str]:
    stream = kit.capturing
    assert stream is not None
    prepared = action.prepare(kit) if action.prepare is not None else None
    box: list[Leftover] = [prepared]  # what cleanup must release: the prepared thing until used

    def perform() -> None:
        box[0] = action.perform(kit, prepared)

    try:
        b.ctx_synchronize()
        b.stream_begin_capture(stream, mode)
        b.memset_d8_async(kit.ptr, 1, BUFFER_BYTES, stream)  # a non-empty graph
        if caller == hazards.SAME_THREAD:
            call_result = _result_of(perform)
        else:
            call_result = _on_other_thread(b, context, perform, timeout)
        status = b.stream_is_capturing(stream)
        end_capture = _result_of(lambda: b.graph_destroy(b.stream_end_capture(stream)))
        if b.stream_is_capturing(stream) is not CaptureStatus.NONE:
            raise RuntimeError(f"{action.row}: the capture stayed open after stream_end_capture")
    finally:
        if box[0] is not None:
            kit.leftovers.append(box[0])
    return call_result, status, end_capture


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
