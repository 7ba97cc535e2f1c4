"""Facade calls named the way the hazard table names them, and one trial per table call.

`capsafe.hazards` says which *call* breaks which capture; this module connects
that table to the driver facade in both directions:

- `hazard_call(method, stream, capturing)` names the `hazards.CALLS` entry a
  facade method exercises (the simulated device uses it to apply the table, and
  the gated driver to decide which calls take the capture gate's shared side);
- `ACTIONS` performs each table call on any `Backend`, against the resources a
  `Trial` prepared before the capture began, and `run_trial` runs one cell of the
  hazard matrix with it, so the sim and the real driver are measured by the very
  same code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.errors import CudaError, UsageError
from capsafe.handles import (
    LEGACY_STREAM,
    CaptureMode,
    CaptureStatus,
    Context,
    Device,
    DevicePtr,
    Event,
    HostPtr,
    MemHandle,
    Module,
    Stream,
    StreamKind,
)

#: Facade methods whose hazard call does not depend on their arguments.
METHOD_CALLS: dict[str, str] = {
    "mem_alloc": "mem_alloc",
    "mem_free": "mem_free",
    "mem_host_alloc": "host_alloc",
    "mem_free_host": "host_free",
    "module_load_data": "module_load",
    "module_unload": "module_unload",
    "event_create": "event_create",
    "event_destroy": "event_destroy",
    "event_synchronize": "event_sync_other",
    "stream_create": "stream_create",
    "stream_destroy": "stream_destroy",
    "ctx_synchronize": "ctx_sync",
    "memcpy_htod": "memcpy_htod",
    "memcpy_dtoh": "memcpy_dtoh",
    "memset_d8": "memset_sync",
    "mem_get_info": "mem_get_info",
    "primary_ctx_retain": "primary_ctx_release_retain",
    "primary_ctx_release": "primary_ctx_release_retain",
    "mem_create": "vmm_map",
    "mem_address_reserve": "vmm_map",
    "mem_map": "vmm_map",
    "mem_set_access": "vmm_map",
    "mem_unmap": "vmm_unmap",
    "mem_release": "vmm_unmap",
    "mem_address_free": "vmm_unmap",
}

#: Facade methods that put work on their `stream` argument. On the capturing
#: stream that work is captured (no hazard); on another stream it is the table's
#: "async work on another stream" or "work on the legacy stream".
STREAM_WORK_METHODS: frozenset[str] = frozenset(
    {
        "memcpy_htod_async",
        "memcpy_dtoh_async",
        "memset_d8_async",
        "launch_kernel",
        "event_record",
        "stream_wait_event",
        "graph_launch",
        "mem_alloc_async",
        "mem_free_async",
    }
)

#: Facade methods that wait on their `stream` argument.
STREAM_WAIT_METHODS: frozenset[str] = frozenset({"stream_synchronize", "stream_query"})

assert set(METHOD_CALLS.values()) <= hazards.CALLS.keys()


def hazard_call(
    method: str, stream: Stream | None = None, capturing: Stream | None = None
) -> str | None:
    """The `hazards.CALLS` name of facade `method` on `stream`, seen by a capture on `capturing`.

    None means the table does not concern the call (device queries, capture and
    graph management, or work captured on the capturing stream itself). Without
    `capturing`, `stream` is taken to be some other stream, the conservative view.
    """
    on_capturing = stream is not None and capturing is not None and stream.value == capturing.value
    if method in STREAM_WAIT_METHODS:
        if on_capturing:
            return "stream_query_capturing"
        return "stream_sync_other" if method == "stream_synchronize" else None
    if method in STREAM_WORK_METHODS:
        if on_capturing:
            return None
        if stream is None or stream.value == LEGACY_STREAM.value:
            return "memset_async_legacy"
        if method in ("mem_alloc_async", "mem_free_async"):
            return "mem_alloc_async_other"
        return "memset_async_other_nonblocking"
    return METHOD_CALLS.get(method)


# ---------------------------------------------------------------------------
# The hazard-matrix trial: the same actions on any backend.
# ---------------------------------------------------------------------------

#: A module every driver accepts: PTX ISA 8.0 (CUDA 12.0 and later), sm_90, one empty kernel.
NOOP_PTX = b"""\
.version 8.0
.target sm_90
.address_size 64

.visible .entry capsafe_noop()
{
\tret;
}
\x00"""
NOOP_KERNEL = "capsafe_noop"

BUFFER_BYTES = 1 << 16


@dataclass
class Trial:
    """Everything an action needs, created before the capture begins.

    A trial holds its own primary-context reference, so the release-and-retain
    action never drops the refcount to zero (which would tear the context down).
    """

    backend: Backend
    device: Device
    context: Context
    stream: Stream  # the stream that will capture
    other_stream: Stream  # non-blocking, not capturing
    spare_stream: Stream  # for stream_destroy
    ptr: DevicePtr  # BUFFER_BYTES of device memory the copies and fills use
    spare_ptr: DevicePtr  # for mem_free
    host: HostPtr  # BUFFER_BYTES of pinned host memory
    spare_host: HostPtr  # for mem_free_host
    module: Module  # for module_unload
    spare_event: Event  # for event_destroy
    other_event: Event  # recorded on other_stream, for event_synchronize
    vmm: tuple[MemHandle, DevicePtr]  # mapped and accessible, for the unmap action
    granularity: int
    made: list[Any] = field(default_factory=list)  # what actions created, for cleanup
    released: set[str] = field(default_factory=set)  # setup resources an action released

    def release(self, attr: str, release: Callable[[Any], Any]) -> None:
        """Release the setup resource `attr`; once it succeeded, cleanup must not repeat it.

        Releasing a handle twice is undefined behaviour in the real driver (seen on
        the H200 as a segfault in cleanup after a successful cuStreamDestroy).
        """
        release(getattr(self, attr))
        self.released.add(attr)

    @classmethod
    def setup(cls, backend: Backend, stream_kind: StreamKind | str) -> Trial:
        """Create the trial's resources; the calling thread must have the context bound."""
        b = backend
        device = b.device_get(0)
        context = b.primary_ctx_retain(device)
        stream = b.stream_create(nonblocking=StreamKind(stream_kind) is StreamKind.NONBLOCKING)
        other = b.stream_create(nonblocking=True)
        granularity = b.mem_get_allocation_granularity(device)
        handle = b.mem_create(granularity, device)
        va = b.mem_address_reserve(granularity)
        b.mem_map(va, granularity, handle)
        b.mem_set_access(va, granularity, device)
        other_event = b.event_create()
        b.event_record(other_event, other)
        trial = cls(
            backend=b,
            device=device,
            context=context,
            stream=stream,
            other_stream=other,
            spare_stream=b.stream_create(nonblocking=True),
            ptr=b.mem_alloc(BUFFER_BYTES),
            spare_ptr=b.mem_alloc(BUFFER_BYTES),
            host=b.mem_host_alloc(BUFFER_BYTES),
            spare_host=b.mem_host_alloc(BUFFER_BYTES),
            module=b.module_load_data(NOOP_PTX),
            spare_event=b.event_create(),
            other_event=other_event,
            vmm=(handle, va),
            granularity=granularity,
        )
        b.ctx_synchronize()
        return trial

    def cleanup(self) -> None:
        """Release what the trial and its action created; errors are ignored (best effort)."""
        b = self.backend
        steps: list[Callable[[], Any]] = [b.ctx_synchronize]
        for thing in self.made:
            steps.append(lambda thing=thing: _release(b, thing, self))
        owned = [
            ("ptr", b.mem_free),
            ("spare_ptr", b.mem_free),
            ("host", b.mem_free_host),
            ("spare_host", b.mem_free_host),
            ("module", b.module_unload),
            ("spare_event", b.event_destroy),
            ("other_event", b.event_destroy),
            ("spare_stream", b.stream_destroy),
            ("other_stream", b.stream_destroy),
            ("stream", b.stream_destroy),
        ]
        for attr, release in owned:
            if attr not in self.released:
                steps.append(lambda release=release, attr=attr: release(getattr(self, attr)))
        if "vmm" not in self.released:
            steps.append(lambda: _release(b, self.vmm, self))
        steps.append(lambda: b.primary_ctx_release(self.device))
        for step in steps:
            with contextlib.suppress(CudaError):
                step()


def _release(b: Backend, thing: Any, trial: Trial) -> None:
    if isinstance(thing, DevicePtr):
        b.mem_free(thing)
    elif isinstance(thing, HostPtr):
        b.mem_free_host(thing)
    elif isinstance(thing, Module):
        b.module_unload(thing)
    elif isinstance(thing, Event):
        b.event_destroy(thing)
    elif isinstance(thing, Stream):
        b.stream_destroy(thing)
    elif isinstance(thing, tuple):  # a VMM mapping: (handle, va)
        handle, va = thing
        b.mem_unmap(va, trial.granularity)
        b.mem_release(handle)
        b.mem_address_free(va, trial.granularity)


def _vmm_map(b: Backend, t: Trial) -> None:
    handle = b.mem_create(t.granularity, t.device)
    va = b.mem_address_reserve(t.granularity)
    b.mem_map(va, t.granularity, handle)
    b.mem_set_access(va, t.granularity, t.device)
    t.made.append((handle, va))


def _vmm_unmap(b: Backend, t: Trial) -> None:
    t.release("vmm", lambda mapping: _release(b, mapping, t))


def _mem_alloc_free(b: Backend, t: Trial) -> None:
    b.mem_free(b.mem_alloc(BUFFER_BYTES))


def _primary_ctx_release_retain(b: Backend, t: Trial) -> None:
    b.primary_ctx_release(t.device)
    b.primary_ctx_retain(t.device)


#: One action per `hazards.CALLS` entry: the call the table row is about, made once.
ACTIONS: dict[str, Callable[[Backend, Trial], None]] = {
    "noop": lambda b, t: None,
    "mem_alloc": lambda b, t: t.made.append(b.mem_alloc(BUFFER_BYTES)),
    "mem_free": lambda b, t: t.release("spare_ptr", b.mem_free),
    "mem_alloc_free": _mem_alloc_free,
    "mem_alloc_async_other": lambda b, t: t.made.append(
        b.mem_alloc_async(BUFFER_BYTES, t.other_stream)
    ),
    "host_alloc": lambda b, t: t.made.append(b.mem_host_alloc(BUFFER_BYTES)),
    "host_free": lambda b, t: t.release("spare_host", b.mem_free_host),
    "module_load": lambda b, t: t.made.append(b.module_load_data(NOOP_PTX)),
    "module_unload": lambda b, t: t.release("module", b.module_unload),
    "event_create": lambda b, t: t.made.append(b.event_create()),
    "event_destroy": lambda b, t: t.release("spare_event", b.event_destroy),
    "event_sync_other": lambda b, t: b.event_synchronize(t.other_event),
    "stream_create": lambda b, t: t.made.append(b.stream_create(nonblocking=True)),
    "stream_destroy": lambda b, t: t.release("spare_stream", b.stream_destroy),
    "stream_sync_other": lambda b, t: b.stream_synchronize(t.other_stream),
    "stream_query_capturing": lambda b, t: b.stream_query(t.stream),
    "ctx_sync": lambda b, t: b.ctx_synchronize(),
    "memcpy_htod": lambda b, t: b.memcpy_htod(t.ptr, t.host.buffer),
    "memcpy_dtoh": lambda b, t: b.memcpy_dtoh(t.host.buffer, t.ptr),
    "memset_sync": lambda b, t: b.memset_d8(t.ptr, 0, BUFFER_BYTES),
    "memset_async_legacy": lambda b, t: b.memset_d8_async(t.ptr, 0, BUFFER_BYTES, LEGACY_STREAM),
    "memset_async_other_nonblocking": lambda b, t: b.memset_d8_async(
        t.ptr, 0, BUFFER_BYTES, t.other_stream
    ),
    "mem_get_info": lambda b, t: b.mem_get_info(),
    "primary_ctx_release_retain": _primary_ctx_release_retain,
    "vmm_map": _vmm_map,
    "vmm_unmap": _vmm_unmap,
}

assert ACTIONS.keys() == hazards.CALLS.keys()


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
    TimeoutError (a hang is a finding, not a result).
    """
    action = ACTIONS[call]
    mode, stream_kind = CaptureMode.parse(mode), StreamKind(stream_kind)
    if caller not in hazards.CALLERS:
        raise UsageError(f"unknown caller {caller!r}; use one of: {', '.join(hazards.CALLERS)}")
    b = backend
    device = b.device_get(0)
    context = b.primary_ctx_retain(device)
    previous = b.ctx_get_current()
    b.ctx_set_current(context)
    trial = Trial.setup(b, stream_kind)
    try:
        b.stream_begin_capture(trial.stream, mode)
        b.memset_d8_async(trial.ptr, 1, BUFFER_BYTES, trial.stream)  # a non-empty graph
        if caller == hazards.SAME_THREAD:
            call_result = _result_of(lambda: action(b, trial))
        else:
            call_result = _on_other_thread(b, context, lambda: action(b, trial), timeout)
        status = b.stream_is_capturing(trial.stream)
        end_capture = _result_of(lambda: b.graph_destroy(b.stream_end_capture(trial.stream)))
        if b.stream_is_capturing(trial.stream) is not CaptureStatus.NONE:
            raise RuntimeError(f"{call}: the capture stayed open after stream_end_capture")
    finally:
        trial.cleanup()
        b.ctx_set_current(previous)
        b.primary_ctx_release(device)
    return TrialResult(
        call, mode.value, stream_kind.value, caller, call_result, status.value, end_capture
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
