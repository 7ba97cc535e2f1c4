"""TestStream: everything on one stream, one synchronize orders it, the block cleans up."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

from capsafe import nvrtc
from capsafe.backend import Backend
from capsafe.errors import CudaError, UsageError
from capsafe.kernel_cache import KernelCache
from capsafe.streams import TestStream


class CallLog:
    """Delegates to a backend and records the names of the calls made through it."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._backend, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attribute(*args, **kwargs)

        return call


def test_fill_write_read_round_trip(backend: Backend) -> None:
    with TestStream(backend) as ts:
        ptr = ts.alloc(256)
        ts.fill(ptr, 0x11)
        assert ts.read(ptr) == b"\x11" * 256
        ts.write(ptr, bytes(range(128)))
        ts.fill(ptr + 128, 0x22, 64)
        data = ts.read(ptr)
        assert data[:128] == bytes(range(128))
        assert data[128:192] == b"\x22" * 64
        assert data[192:] == b"\x11" * 64
        assert ts.read(ptr, 4) == bytes(range(4))


def test_write_copies_the_source_so_it_may_be_reused(backend: Backend) -> None:
    with TestStream(backend) as ts:
        ptr = ts.alloc(64)
        source = bytearray(b"a" * 64)
        ts.write(ptr, source)
        source[:] = b"b" * 64
        assert ts.read(ptr) == b"a" * 64


def test_reads_after_a_fill_on_the_same_stream_never_see_stale_bytes(backend: Backend) -> None:
    with TestStream(backend) as ts:
        ptr = ts.alloc(1 << 20)
        ts.fill(ptr, 0)
        for value in range(1, 9):
            ts.fill(ptr, value)
            assert ts.read(ptr).count(value) == 1 << 20


def test_the_legacy_stream_read_it_prevents_is_stale_on_the_sim(sim_backend: Backend) -> None:
    """The race itself: fill on a non-blocking stream, synchronous read on the legacy stream."""
    size = 4096
    stream = sim_backend.stream_create(nonblocking=True)
    ptr = sim_backend.mem_alloc(size)
    try:
        sim_backend.memset_d8(ptr, 0, size)
        sim_backend.memset_d8_async(ptr, 0x7F, size, stream)
        host = bytearray(size)
        sim_backend.memcpy_dtoh(host, ptr, size)
        assert host == bytes(size), "the sim should show the legacy-stream read as stale"
    finally:
        sim_backend.stream_synchronize(stream)
        sim_backend.mem_free(ptr)
        sim_backend.stream_destroy(stream)

    with TestStream(sim_backend) as ts:
        ptr = ts.alloc(size)
        ts.fill(ptr, 0)
        ts.fill(ptr, 0x7F)
        assert ts.read(ptr) == b"\x7f" * size


def test_leaving_the_block_synchronizes_then_frees_then_destroys(sim_backend: Backend) -> None:
    log = CallLog(sim_backend)
    with TestStream(log) as ts:  # type: ignore[arg-type]
        ts.fill(ts.alloc(16), 1)
        ts.alloc(32)
    assert log.calls[-4:] == ["stream_synchronize", "mem_free", "mem_free", "stream_destroy"]


def test_leaving_on_an_exception_still_frees(sim_backend: Backend) -> None:
    log = CallLog(sim_backend)
    with pytest.raises(RuntimeError, match="boom"), TestStream(log) as ts:  # type: ignore[arg-type]
        ts.alloc(16)
        raise RuntimeError("boom")
    assert log.calls[-3:] == ["stream_synchronize", "mem_free", "stream_destroy"]


def test_the_stream_is_non_blocking_and_exposed_as_raw(backend: Backend) -> None:
    with TestStream(backend) as ts:
        assert ts.raw.kind == "nonblocking"
        assert ts.backend is backend
        ptr = ts.alloc(8)
        backend.memset_d8_async(ptr, 3, 8, ts.raw)
        ts.synchronize()
        assert ts.read(ptr) == b"\x03" * 8


def test_use_outside_the_block_is_a_usage_error(sim_backend: Backend) -> None:
    ts = TestStream(sim_backend)
    with pytest.raises(UsageError):
        ts.alloc(8)
    with ts:
        pass
    with pytest.raises(UsageError):
        ts.synchronize()


def test_default_binds_the_process_device_on_this_thread() -> None:
    import capsafe

    with TestStream() as ts:
        assert ts.backend is capsafe.device(0).backend
        ptr = ts.alloc(16)
        ts.fill(ptr, 9)
        assert ts.read(ptr) == b"\x09" * 16


def test_an_unbound_explicit_backend_fails_with_invalid_context(sim_backend: Backend) -> None:
    sim_backend.ctx_set_current(None)
    with pytest.raises(CudaError) as caught, TestStream(sim_backend):
        pass
    assert caught.value.result == "CUDA_ERROR_INVALID_CONTEXT"


ADD_ONE = r"""
extern "C" __global__ void add_one(unsigned char* data, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) data[i] += 1;
}
"""


def _add_one_standin(memory: Any, grid: Any, block: Any, args: Any) -> None:
    ptr, n = args[0], args[1].value
    memory.write(ptr, bytes((b + 1) % 256 for b in memory.read(ptr, n)))


def test_launch_runs_in_stream_order_with_fills_and_reads(
    backend: Backend, sim_kernel: Any, tmp_path: Path
) -> None:
    sim_kernel("add_one", _add_one_standin)
    spec = nvrtc.KernelSpec(ADD_ONE, "add_one.cu")
    loaded = nvrtc.load(spec, backend, backend.device_get(0), cache=KernelCache(tmp_path))
    function = backend.module_get_function(loaded.module, "add_one")
    try:
        with TestStream(backend) as ts:
            ptr = ts.alloc(1000)
            ts.fill(ptr, 41)
            ts.launch(function, (4, 1, 1), (256, 1, 1), [ptr, ctypes.c_int(1000)])
            ts.launch(function, (4, 1, 1), (256, 1, 1), [ptr, ctypes.c_int(500)])
            data = ts.read(ptr)
        assert data == b"\x2b" * 500 + b"\x2a" * 500
    finally:
        backend.module_unload(loaded.module)
