"""Captures on the sim follow the measured hazard table, cell by cell, from the same actions
the hazard-matrix reproducer runs on the GPU."""

from __future__ import annotations

import inspect
import threading

import pytest

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.errors import CaptureInvalidated, CudaError
from capsafe.handles import LEGACY_STREAM, CaptureMode, CaptureStatus, Stream, StreamKind
from capsafe.hazards.actions import ACTIONS
from capsafe.hazards.calls import (
    METHOD_CALLS,
    STREAM_WAIT_METHODS,
    STREAM_WORK_METHODS,
    hazard_call,
)
from capsafe.hazards.trial import run_trial
from capsafe.sim import SimBackend

CELLS = list(hazards.cells())
LEFT_OPEN_CELLS = list(hazards.cells(state=hazards.LEFT_OPEN))


@pytest.mark.parametrize(
    ("call", "mode", "stream", "caller", "device", "state"),
    CELLS,
    ids=["-".join(map(str, c[:4])) for c in CELLS],
)
def test_every_cell_matches_the_table(
    call: str, mode: CaptureMode, stream: StreamKind, caller: str, device: str, state: str
) -> None:
    backend = SimBackend()
    backend.init()
    result = run_trial(backend, call, mode, stream, caller, timeout=10)
    assert result.outcome == hazards.expected(call, mode, stream, caller, device)
    assert result.device == device == hazards.SAME_DEVICE
    assert result.state == state == hazards.ACTIVE
    broken = result.outcome.breaks_capture
    assert result.capturing_after == ("invalidated" if broken else "active")


@pytest.mark.parametrize(
    ("call", "mode", "stream", "caller", "device", "state"),
    LEFT_OPEN_CELLS,
    ids=["-".join(map(str, c[:4])) for c in LEFT_OPEN_CELLS],
)
def test_every_left_open_cell_matches_the_table(
    call: str, mode: CaptureMode, stream: StreamKind, caller: str, device: str, state: str
) -> None:
    """With an invalidated capture left open the call gets the table's LEFT_OPEN answer."""
    backend = SimBackend()
    backend.init()
    result = run_trial(backend, call, mode, stream, caller, device, state, timeout=10)
    want = hazards.expected(call, mode, stream, caller, device, state)
    assert result.outcome == want
    assert want.end_capture == hazards.INVALIDATED
    assert result.capturing_after == "invalidated"


def test_the_matrix_covers_the_issue_minimum() -> None:
    assert len(ACTIONS) >= 20
    assert len(CELLS) == len(ACTIONS) * 3 * 2 * 2


def test_mapping_names_real_facade_methods() -> None:
    methods = {name for name, _ in inspect.getmembers(Backend, inspect.isfunction)}
    assert set(METHOD_CALLS) <= methods
    assert methods >= STREAM_WORK_METHODS
    assert methods >= STREAM_WAIT_METHODS


def test_hazard_call_depends_on_the_stream() -> None:
    capturing = Stream(0x10, kind=StreamKind.BLOCKING)
    other = Stream(0x20, kind=StreamKind.NONBLOCKING)
    assert hazard_call("stream_synchronize", capturing, capturing) == "stream_query_capturing"
    assert hazard_call("stream_query", capturing, capturing) == "stream_query_capturing"
    assert hazard_call("stream_synchronize", other, capturing) == "stream_sync_other"
    assert hazard_call("stream_query", other, capturing) is None
    assert hazard_call("memset_d8_async", capturing, capturing) is None  # captured
    assert hazard_call("memset_d8_async", LEGACY_STREAM, capturing) == "memset_async_legacy"
    assert hazard_call("launch_kernel", other, capturing) == "memset_async_other_nonblocking"
    assert hazard_call("mem_alloc_async", other, capturing) == "mem_alloc_async_other"
    assert hazard_call("mem_alloc_async", other) == "mem_alloc_async_other"  # gate's view
    assert hazard_call("memset_d8") == "memset_sync"
    assert hazard_call("device_get_name") is None


def test_capturing_the_legacy_stream_is_unsupported(sim_backend: SimBackend) -> None:
    with pytest.raises(CudaError) as info:
        sim_backend.stream_begin_capture(LEGACY_STREAM, CaptureMode.GLOBAL)
    assert info.value.result == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"


def test_double_begin_and_end_without_begin_are_illegal_state(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    with pytest.raises(CudaError) as info:
        b.stream_end_capture(stream)
    assert info.value.result == "CUDA_ERROR_ILLEGAL_STATE"
    b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    with pytest.raises(CudaError) as info:
        b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    assert info.value.result == "CUDA_ERROR_ILLEGAL_STATE"
    assert b.stream_is_capturing(stream) is CaptureStatus.ACTIVE
    b.graph_destroy(b.stream_end_capture(stream))
    assert b.stream_is_capturing(stream) is CaptureStatus.NONE


def test_invalidated_capture_refuses_work_and_ends_with_capture_invalidated(
    sim_backend: SimBackend,
) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(16)
    b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    with pytest.raises(CudaError) as info:
        b.mem_alloc(16)
    assert info.value.result == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert info.value.call == "cuMemAlloc"
    assert b.stream_is_capturing(stream) is CaptureStatus.INVALIDATED
    with pytest.raises(CaptureInvalidated):
        b.memset_d8_async(ptr, 1, 16, stream)
    with pytest.raises(CaptureInvalidated) as ended:
        b.stream_end_capture(stream)
    assert ended.value.call == "cuStreamEndCapture"
    assert b.stream_is_capturing(stream) is CaptureStatus.NONE
    b.mem_alloc(16)  # no capture left: allowed again


def test_another_threads_allocation_fails_and_breaks_a_global_capture(
    sim_backend: SimBackend,
) -> None:
    """The design brief's first consequence: under GLOBAL both sides lose."""
    b = sim_backend
    stream = b.stream_create()
    b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    context = b.ctx_get_current()
    seen: list[str] = []

    def allocate() -> None:
        b.ctx_set_current(context)
        try:
            b.mem_alloc(1024)
            seen.append("CUDA_SUCCESS")
        except CudaError as exc:
            seen.append(exc.result)

    worker = threading.Thread(target=allocate)
    worker.start()
    worker.join(10)
    assert seen == ["CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"]
    with pytest.raises(CaptureInvalidated):
        b.stream_end_capture(stream)


def test_global_capture_must_end_on_its_own_thread_relaxed_need_not(
    sim_backend: SimBackend,
) -> None:
    b = sim_backend
    context = b.ctx_get_current()
    results: dict[str, str] = {}
    streams = {mode: b.stream_create() for mode in (CaptureMode.GLOBAL, CaptureMode.RELAXED)}
    for mode, stream in streams.items():
        b.stream_begin_capture(stream, mode)

    def end_elsewhere() -> None:
        b.ctx_set_current(context)
        for mode, stream in streams.items():
            try:
                b.stream_end_capture(stream)
                results[mode] = "CUDA_SUCCESS"
            except CudaError as exc:
                results[mode] = exc.result

    worker = threading.Thread(target=end_elsewhere)
    worker.start()
    worker.join(10)
    assert results == {
        "global": "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        "relaxed": "CUDA_SUCCESS",
    }
    b.stream_end_capture(streams[CaptureMode.GLOBAL])


def test_two_captures_are_each_checked(sim_backend: SimBackend) -> None:
    b = sim_backend
    relaxed, global_ = b.stream_create(), b.stream_create()
    b.stream_begin_capture(relaxed, CaptureMode.RELAXED)
    b.stream_begin_capture(global_, CaptureMode.GLOBAL)
    with pytest.raises(CudaError):
        b.mem_alloc(8)
    assert b.stream_is_capturing(relaxed) is CaptureStatus.ACTIVE
    assert b.stream_is_capturing(global_) is CaptureStatus.INVALIDATED
    with pytest.raises(CudaError):
        b.ctx_synchronize()  # breaks every capture
    assert b.stream_is_capturing(relaxed) is CaptureStatus.INVALIDATED


def test_synchronizing_the_capturing_stream_breaks_it(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create(nonblocking=False)
    b.stream_begin_capture(stream, CaptureMode.RELAXED)
    with pytest.raises(CudaError) as info:
        b.stream_synchronize(stream)
    assert info.value.result == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    # A query of the broken capture's stream is still refused, in every mode (H200,
    # 2026-12-02, hazard_matrix --left-open), not answered INVALIDATED.
    with pytest.raises(CudaError) as info:
        b.stream_query(stream)
    assert info.value.result == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    with pytest.raises(CaptureInvalidated):
        b.stream_end_capture(stream)


def test_pending_work_from_before_the_capture_still_runs(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(4)
    b.memset_d8_async(ptr, 6, 4, stream)
    b.stream_begin_capture(stream, CaptureMode.THREAD_LOCAL)
    b.memset_d8_async(ptr, 9, 4, stream)
    graph = b.stream_end_capture(stream)
    b.stream_synchronize(stream)
    out = bytearray(4)
    b.memcpy_dtoh(out, ptr)
    assert out == bytes([6]) * 4
    b.graph_destroy(graph)
