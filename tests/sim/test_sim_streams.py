"""Lazy stream execution: work runs in order per stream, only when something waits on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from capsafe.errors import CudaError
from capsafe.handles import LEGACY_STREAM, CaptureMode, DevicePtr
from capsafe.sim import SimBackend

N = 4096


def read(b: SimBackend, ptr: DevicePtr, n: int = N) -> bytes:
    out = bytearray(n)
    b.memcpy_dtoh(out, ptr)
    return bytes(out)


def test_legacy_stream_read_after_nonblocking_fill_is_stale_until_synchronized(
    sim_backend: SimBackend,
) -> None:
    """The done-when line of issue 2: the race shows every time, and the fix fixes it."""
    b = sim_backend
    stream = b.stream_create(nonblocking=True)
    ptr = b.mem_alloc(N)
    b.memset_d8(ptr, 0x11, N)
    b.memset_d8_async(ptr, 0x22, N, stream)
    assert read(b, ptr) == bytes([0x11]) * N  # synchronous copy on the legacy stream: stale
    b.stream_synchronize(stream)
    assert read(b, ptr) == bytes([0x22]) * N


def test_same_race_on_a_blocking_stream_is_ordered_by_the_legacy_stream(
    sim_backend: SimBackend,
) -> None:
    b = sim_backend
    stream = b.stream_create(nonblocking=False)
    ptr = b.mem_alloc(N)
    b.memset_d8_async(ptr, 0x33, N, stream)
    assert read(b, ptr) == bytes([0x33]) * N  # legacy work waits for blocking streams


def test_blocking_stream_work_waits_for_earlier_legacy_work(sim_backend: SimBackend) -> None:
    b = sim_backend
    blocking = b.stream_create(nonblocking=False)
    nonblocking = b.stream_create(nonblocking=True)
    ptr = b.mem_alloc(N)
    b.memset_d8_async(ptr, 0x44, N, LEGACY_STREAM)
    out_blocking, out_nonblocking = bytearray(N), bytearray(N)
    b.memcpy_dtoh_async(out_nonblocking, ptr, nonblocking)
    b.memcpy_dtoh_async(out_blocking, ptr, blocking)
    b.stream_synchronize(nonblocking)
    b.stream_synchronize(blocking)
    assert out_nonblocking == bytes(N)  # ran without waiting for the legacy memset
    assert out_blocking == bytes([0x44]) * N


def test_work_runs_lazily_and_in_order_per_stream(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(4)
    out = bytearray(4)
    b.memcpy_htod_async(ptr, b"abcd", stream)
    b.memset_d8_async(ptr + 1, ord("z"), 2, stream)
    b.memcpy_dtoh_async(out, ptr, stream)
    b.memset_d8_async(ptr, 0, 4, stream)
    assert out == bytes(4)  # nothing ran: nobody waited
    b.stream_synchronize(stream)
    assert out == b"azzd"  # the read saw exactly the work before it
    assert read(b, ptr, 4) == bytes(4)


def test_async_copies_use_the_host_buffer_when_they_run(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(3)
    src = bytearray(b"old")
    b.memcpy_htod_async(ptr, src, stream)
    src[:] = b"new"  # changed before the copy ran: the device sees the new bytes
    b.stream_synchronize(stream)
    assert read(b, ptr, 3) == b"new"


def test_ctx_synchronize_runs_every_stream(sim_backend: SimBackend) -> None:
    b = sim_backend
    streams = [b.stream_create(nonblocking=nb) for nb in (True, False, True)]
    ptrs = [b.mem_alloc(8) for _ in streams]
    for value, (s, p) in enumerate(zip(streams, ptrs, strict=True), start=1):
        b.memset_d8_async(p, value, 8, s)
    b.ctx_synchronize()
    assert [read(b, p, 8) for p in ptrs] == [bytes([v]) * 8 for v in (1, 2, 3)]


def test_stream_query_answers_not_ready_once_then_ready(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(8)
    assert b.stream_query(stream) is True
    b.memset_d8_async(ptr, 9, 8, stream)
    polls = 0
    while not b.stream_query(stream):
        polls += 1
        assert polls < 10
    assert polls == 1
    assert read(b, ptr, 8) == bytes([9]) * 8


def test_event_synchronize_runs_the_stream_up_to_the_event_only(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(N)
    ev = b.event_create()
    b.memset_d8_async(ptr, 1, N, stream)
    b.event_record(ev, stream)
    b.memset_d8_async(ptr, 2, N, stream)
    b.event_synchronize(ev)
    assert read(b, ptr) == bytes([1]) * N
    assert b.stream_query(stream) is False  # the second fill was still pending
    assert read(b, ptr) == bytes([2]) * N


def test_event_query_and_unrecorded_events(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ev = b.event_create(timing=True)
    assert b.event_query(ev) is True  # never recorded: complete
    b.event_synchronize(ev)
    b.memset_d8_async(b.mem_alloc(1), 1, 1, stream)
    b.event_record(ev, stream)
    assert b.event_query(ev) is False
    assert b.event_query(ev) is True
    b.event_destroy(ev)
    with pytest.raises(CudaError) as info:
        b.event_query(ev)
    assert info.value.result == "CUDA_ERROR_INVALID_HANDLE"


def test_stream_wait_event_orders_one_stream_after_another(sim_backend: SimBackend) -> None:
    b = sim_backend
    producer, consumer = b.stream_create(), b.stream_create()
    ptr = b.mem_alloc(N)
    out = bytearray(N)
    ev = b.event_create()
    b.memset_d8_async(ptr, 7, N, producer)
    b.event_record(ev, producer)
    b.memset_d8_async(ptr, 8, N, producer)  # after the event: the consumer must not wait for it
    b.stream_wait_event(consumer, ev)
    b.memcpy_dtoh_async(out, ptr, consumer)
    b.stream_synchronize(consumer)
    assert out == bytes([7]) * N
    assert b.event_query(ev) is True


def test_stream_ordered_alloc_and_free(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    free0 = b.mem_get_info()[0]
    ptr = b.mem_alloc_async(N, stream)
    b.memset_d8_async(ptr, 5, N, stream)
    out = bytearray(N)
    b.memcpy_dtoh_async(out, ptr, stream)
    b.mem_free_async(ptr, stream)
    with pytest.raises(CudaError):
        b.mem_free_async(ptr, stream)  # already being freed
    b.stream_synchronize(stream)
    assert out == bytes([5]) * N
    assert b.mem_get_info()[0] == free0


def test_destroying_a_stream_lets_its_work_finish(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(8)
    b.memset_d8_async(ptr, 3, 8, stream)
    b.stream_destroy(stream)
    assert read(b, ptr, 8) == bytes([3]) * 8
    with pytest.raises(CudaError) as info:
        b.stream_synchronize(stream)
    assert info.value.result == "CUDA_ERROR_INVALID_HANDLE"


# -- graphs ------------------------------------------------------------------------------


def test_captured_memset_runs_only_when_the_graph_is_launched(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(N)
    b.stream_begin_capture(stream, CaptureMode.THREAD_LOCAL)
    b.memset_d8_async(ptr, 0x5A, N, stream)
    graph = b.stream_end_capture(stream)
    assert read(b, ptr) == bytes(N)  # capture records, it does not run
    exec_ = b.graph_instantiate(graph)
    b.graph_launch(exec_, stream)
    assert read(b, ptr) == bytes(N)  # launched on a non-blocking stream, not yet waited on
    b.stream_synchronize(stream)
    assert read(b, ptr) == bytes([0x5A]) * N
    b.memset_d8(ptr, 0, N)
    b.graph_launch(exec_, stream)  # launch twice
    b.stream_synchronize(stream)
    assert read(b, ptr) == bytes([0x5A]) * N
    b.graph_exec_destroy(exec_)
    b.graph_destroy(graph)
    call: Callable[[Any], object]
    handle: Any
    for call, handle in ((b.graph_destroy, graph), (b.graph_exec_destroy, exec_)):
        with pytest.raises(CudaError) as info:
            call(handle)
        assert info.value.result == "CUDA_ERROR_INVALID_HANDLE"


def test_graph_with_captured_alloc_copy_and_event(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    src = b.mem_alloc(4)
    b.memcpy_htod(src, b"data")
    out = bytearray(4)
    ev = b.event_create()
    free0 = b.mem_get_info()[0]
    b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    scratch = b.mem_alloc_async(4, stream)
    b.memset_d8_async(scratch, 1, 4, stream)
    b.memcpy_dtoh_async(out, src, stream)
    b.event_record(ev, stream)
    b.mem_free_async(scratch, stream)
    graph = b.stream_end_capture(stream)
    assert b.mem_get_info()[0] < free0  # the graph owns its allocation
    exec_ = b.graph_instantiate(graph)
    b.graph_destroy(graph)
    b.graph_launch(exec_, stream)
    b.event_synchronize(ev)
    assert out == b"data"
    b.graph_exec_destroy(exec_)
    assert b.mem_get_info()[0] == free0


def test_graph_launch_after_its_memory_was_freed_fails(sim_backend: SimBackend) -> None:
    b = sim_backend
    stream = b.stream_create()
    ptr = b.mem_alloc(8)
    b.stream_begin_capture(stream, CaptureMode.RELAXED)
    b.memset_d8_async(ptr, 1, 8, stream)
    exec_ = b.graph_instantiate(b.stream_end_capture(stream))
    b.mem_free(ptr)
    with pytest.raises(CudaError) as info:
        b.graph_launch(exec_, stream)
    assert info.value.result == "CUDA_ERROR_INVALID_VALUE"


def test_the_legacy_stream_waits_for_blocking_streams_only(sim_backend: SimBackend) -> None:
    b = sim_backend
    blocking, nonblocking = b.stream_create(nonblocking=False), b.stream_create()
    ptr_b, ptr_n = b.mem_alloc(8), b.mem_alloc(8)
    b.memset_d8_async(ptr_b, 1, 8, blocking)
    b.memset_d8_async(ptr_n, 2, 8, nonblocking)
    assert b.stream_query(LEGACY_STREAM) is False  # blocking work counts as legacy work
    assert b.stream_query(blocking) is True
    assert b.stream_query(nonblocking) is False
    b.memset_d8_async(ptr_b, 3, 8, blocking)
    b.memset_d8_async(ptr_n, 4, 8, nonblocking)
    b.stream_synchronize(LEGACY_STREAM)
    assert (read(b, ptr_b, 8), read(b, ptr_n, 8)) == (bytes([3]) * 8, bytes([2]) * 8)


def test_a_long_chain_of_stream_waits_runs_in_order(sim_backend: SimBackend) -> None:
    b = sim_backend
    ptr = b.mem_alloc(1)
    previous = None
    streams = []
    for value in range(1, 1501):  # deeper than Python's default recursion limit
        stream = b.stream_create(nonblocking=value % 2 == 0)
        if previous is not None:
            b.stream_wait_event(stream, previous)
        b.memset_d8_async(ptr, value % 256, 1, stream)
        previous = b.event_create()
        b.event_record(previous, stream)
        streams.append(stream)
    b.stream_synchronize(streams[-1])
    assert read(b, ptr, 1) == bytes([1500 % 256])
    assert all(b.stream_query(s) for s in streams)
