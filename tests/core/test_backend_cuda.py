"""The real-driver backend: CPU checks of its plumbing, and `cuda`-marked runs on a GPU."""

from __future__ import annotations

import ctypes
import types
from collections.abc import Iterator
from typing import Any

import pytest

from capsafe import backend_cuda, hazards
from capsafe.backend import Backend, KernelArg
from capsafe.backend_cuda import CudaBackend, unavailable_reason
from capsafe.errors import CaptureInvalidated, CudaError, UsageError
from capsafe.handles import LEGACY_STREAM, CaptureMode, CaptureStatus, DevicePtr, Stream

driver_api = pytest.importorskip("cuda.bindings.driver")
CUresult = driver_api.CUresult


# -- CPU: no GPU needed -------------------------------------------------------


def test_unavailable_reason_is_one_line_or_none_and_cached() -> None:
    first = unavailable_reason()
    assert first is None or (first and "\n" not in first)
    assert unavailable_reason() is first


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """Swap the cuda.bindings driver module for a namespace the test fills in."""
    fake = types.SimpleNamespace(CUresult=CUresult, CUstream=driver_api.CUstream)
    monkeypatch.setattr(backend_cuda, "_driver_module", lambda: fake)
    backend_cuda.unavailable_reason.cache_clear()
    yield fake
    backend_cuda.unavailable_reason.cache_clear()


def test_unavailable_reason_without_bindings(
    monkeypatch: pytest.MonkeyPatch, fake_driver: types.SimpleNamespace
) -> None:
    def missing() -> None:
        raise ImportError("No module named 'cuda'")

    monkeypatch.setattr(backend_cuda, "_driver_module", missing)
    assert "cuda-bindings is not installed" in (unavailable_reason() or "")


def test_unavailable_reason_when_the_driver_library_is_missing(
    fake_driver: types.SimpleNamespace,
) -> None:
    def no_library(flags: int) -> None:
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found ...')

    fake_driver.cuInit = no_library
    assert (unavailable_reason() or "").startswith("no NVIDIA driver found")


def test_unavailable_reason_with_a_driver_but_no_device(fake_driver: types.SimpleNamespace) -> None:
    fake_driver.cuInit = lambda flags: (CUresult.CUDA_ERROR_NO_DEVICE,)
    assert unavailable_reason() == "driver found but no CUDA device"
    backend_cuda.unavailable_reason.cache_clear()
    fake_driver.cuInit = lambda flags: (CUresult.CUDA_SUCCESS,)
    fake_driver.cuDeviceGetCount = lambda: (CUresult.CUDA_SUCCESS, 0)
    assert unavailable_reason() == "driver found but no CUDA device"


def test_driver_errors_carry_the_result_name_and_the_call(
    fake_driver: types.SimpleNamespace,
) -> None:
    results = iter(
        [
            CUresult.CUDA_SUCCESS,
            CUresult.CUDA_ERROR_NOT_READY,
            CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        ]
    )
    fake_driver.cuStreamQuery = lambda stream: (next(results),)
    backend = CudaBackend()
    stream = Stream(7)
    assert backend.stream_query(stream) is True
    assert backend.stream_query(stream) is False
    with pytest.raises(CudaError) as failed:
        backend.stream_query(stream)
    assert (failed.value.result, failed.value.call) == (hazards.UNSUPPORTED, "cuStreamQuery")
    with pytest.raises(CaptureInvalidated):
        backend.stream_query(stream)


def test_kernel_params_point_at_each_argument_value() -> None:
    params = backend_cuda._KernelParams([DevicePtr(0xABC000), ctypes.c_int(-3)])
    slots = (ctypes.c_void_p * 2).from_address(params.address)
    assert slots[0] is not None and slots[1] is not None
    assert ctypes.c_void_p.from_address(slots[0]).value == 0xABC000
    assert ctypes.c_int.from_address(slots[1]).value == -3
    assert backend_cuda._KernelParams([]).address == 0


def test_kernel_params_refuse_a_bare_int() -> None:
    with pytest.raises(UsageError, match="kernel argument 0 is a int"):
        not_an_argument: Any = 3  # what the type forbids, as an untyped caller passes it
        backend_cuda._KernelParams([not_an_argument])


# -- GPU ----------------------------------------------------------------------

FILL_SOURCE = r"""
extern "C" __global__ void fill(unsigned char* out, int n, unsigned char value) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value + (unsigned char)(i % 7);
}
"""
N = 1 << 16


@pytest.fixture
def gpu() -> Backend:
    """A real backend with device 0's primary context bound in this thread."""
    from capsafe.context import CudaDevice

    backend = CudaBackend()
    backend.init()
    return CudaDevice(backend, 0).bind().backend


@pytest.fixture
def buffer(gpu: Backend) -> Iterator[DevicePtr]:
    ptr = gpu.mem_alloc(N)
    yield ptr
    gpu.mem_free(ptr)


@pytest.mark.cuda
def test_data_round_trips_sync_and_async(gpu: Backend, buffer: DevicePtr) -> None:
    data = bytes(range(256)) * (N // 256)
    gpu.memcpy_htod(buffer, data)
    back = bytearray(N)
    gpu.memcpy_dtoh(back, buffer)
    assert back == data

    stream = gpu.stream_create(nonblocking=True)
    host = gpu.mem_host_alloc(N)
    try:
        gpu.memset_d8_async(buffer, 0x5A, N, stream)
        gpu.memcpy_dtoh_async(host.buffer, buffer, stream)
        gpu.stream_synchronize(stream)
        assert bytes(host.buffer) == b"\x5a" * N
    finally:
        gpu.mem_free_host(host)
        gpu.stream_destroy(stream)


@pytest.mark.cuda
def test_legacy_stream_waits_for_blocking_streams(gpu: Backend, buffer: DevicePtr) -> None:
    blocking = gpu.stream_create(nonblocking=False)
    try:
        gpu.memset_d8(buffer, 0, N)
        gpu.memset_d8_async(buffer, 0x11, N, blocking)
        back = bytearray(N)
        gpu.memcpy_dtoh(back, buffer)  # legacy stream: implicitly after the blocking fill
        assert back == b"\x11" * N
        assert gpu.stream_query(LEGACY_STREAM) is True
    finally:
        gpu.stream_destroy(blocking)


@pytest.mark.cuda
def test_capture_then_graph_launch_replays_the_work(gpu: Backend, buffer: DevicePtr) -> None:
    stream = gpu.stream_create(nonblocking=True)
    try:
        gpu.memset_d8(buffer, 0, N)
        gpu.stream_begin_capture(stream, CaptureMode.THREAD_LOCAL)
        assert gpu.stream_is_capturing(stream) is CaptureStatus.ACTIVE
        gpu.memset_d8_async(buffer, 0x7F, N, stream)
        graph = gpu.stream_end_capture(stream)
        back = bytearray(N)
        gpu.memcpy_dtoh(back, buffer)
        assert back == bytes(N)  # captured, not run
        graph_exec = gpu.graph_instantiate(graph)
        gpu.graph_launch(graph_exec, stream)
        gpu.stream_synchronize(stream)
        gpu.memcpy_dtoh(back, buffer)
        assert back == b"\x7f" * N
        gpu.graph_exec_destroy(graph_exec)
        gpu.graph_destroy(graph)
    finally:
        gpu.stream_destroy(stream)


@pytest.mark.cuda
def test_nvrtc_cubin_loads_and_launches(gpu: Backend, buffer: DevicePtr) -> None:
    out = backend_cuda.nvrtc_compile(
        FILL_SOURCE, "fill.cu", ["--gpu-architecture=sm_90"], {}, "cubin"
    )
    module = gpu.module_load_data(out.image)
    try:
        fill = gpu.module_get_function(module, "fill")
        stream = gpu.stream_create(nonblocking=True)
        args: list[KernelArg] = [buffer, ctypes.c_int(N), ctypes.c_ubyte(3)]
        gpu.launch_kernel(fill, ((N + 255) // 256, 1, 1), (256, 1, 1), args, stream)
        gpu.stream_synchronize(stream)
        gpu.stream_destroy(stream)
        back = bytearray(N)
        gpu.memcpy_dtoh(back, buffer)
        assert back == bytes((3 + i % 7) for i in range(N))
        with pytest.raises(CudaError) as missing:
            gpu.module_get_function(module, "no_such_kernel")
        assert (missing.value.result, missing.value.call) == (
            "CUDA_ERROR_NOT_FOUND",
            "cuModuleGetFunction",
        )
    finally:
        gpu.module_unload(module)


@pytest.mark.cuda
def test_hand_written_ptx_loads(gpu: Backend) -> None:
    from capsafe.hazards.actions import NOOP_KERNEL, NOOP_PTX

    module = gpu.module_load_data(NOOP_PTX.rstrip(b"\0"))  # the backend adds the NUL
    try:
        assert gpu.module_get_function(module, NOOP_KERNEL).name == NOOP_KERNEL
    finally:
        gpu.module_unload(module)


@pytest.mark.cuda
def test_a_global_capture_is_invalidated_by_an_allocation(gpu: Backend) -> None:
    stream = gpu.stream_create(nonblocking=True)
    try:
        gpu.stream_begin_capture(stream, CaptureMode.GLOBAL)
        with pytest.raises(CudaError) as refused:
            gpu.mem_alloc(N)
        assert (refused.value.result, refused.value.call) == (hazards.UNSUPPORTED, "cuMemAlloc")
        assert gpu.stream_is_capturing(stream) is CaptureStatus.INVALIDATED
        with pytest.raises(CaptureInvalidated):
            gpu.stream_end_capture(stream)
    finally:
        gpu.stream_destroy(stream)


@pytest.mark.cuda
def test_events_vmm_and_device_queries(gpu: Backend) -> None:
    device = gpu.device_get(0)
    assert gpu.device_get_count() >= 1
    assert gpu.device_get_name(device)
    assert gpu.device_get_attribute(device, "compute_capability_major") >= 7
    assert gpu.driver_version() >= 12000
    free, total = gpu.mem_get_info()
    assert 0 < free <= total

    stream = gpu.stream_create(nonblocking=True)
    event = gpu.event_create()
    gpu.event_record(event, stream)
    gpu.event_synchronize(event)
    assert gpu.event_query(event) is True
    gpu.stream_wait_event(LEGACY_STREAM, event)
    gpu.event_destroy(event)

    size = gpu.mem_get_allocation_granularity(device)
    handle = gpu.mem_create(size, device)
    va = gpu.mem_address_reserve(size)
    gpu.mem_map(va, size, handle)
    gpu.mem_set_access(va, size, device)
    gpu.memset_d8_async(va, 0x42, size, stream)
    back = bytearray(16)
    gpu.memcpy_dtoh_async(back, va + (size - 16), stream)
    gpu.stream_synchronize(stream)
    assert back == b"\x42" * 16
    gpu.mem_unmap(va, size)
    gpu.mem_release(handle)
    gpu.mem_address_free(va, size)

    ptr = gpu.mem_alloc_async(N, stream)
    gpu.mem_free_async(ptr, stream)
    gpu.stream_synchronize(stream)
    gpu.stream_destroy(stream)


@pytest.mark.cuda
def test_device_ordinal_out_of_range_is_one_line(gpu: Backend) -> None:
    from capsafe.context import CudaDevice

    count = gpu.device_get_count()
    with pytest.raises(UsageError, match=rf"^device {count} requested but only {count} device"):
        CudaDevice(gpu, count)


@pytest.mark.cuda
def test_cuda_device_binds_its_primary_context_in_each_thread(gpu: Backend) -> None:
    import threading

    from capsafe.context import CudaDevice

    dev = CudaDevice(gpu, 0)
    assert dev.compute_capability >= (7, 0) and dev.name
    seen = []

    def worker() -> None:
        seen.append(gpu.ctx_get_current())
        dev.bind()
        seen.append(gpu.ctx_get_current())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert seen[0] is None and seen[1] == dev.context
