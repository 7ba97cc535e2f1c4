"""The sim against the real driver: same data, same error names, same device description.

Every test here runs on the sim everywhere and, on a machine with an H200, on the
real driver too (the `backend` fixture's "cuda" case), which is how the sim's
calibration is re-checked on new hardware or a new driver.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.errors import CaptureInvalidated, CudaError
from capsafe.handles import LEGACY_STREAM, CaptureMode
from capsafe.hazards.actions import NOOP_KERNEL, NOOP_PTX
from capsafe.hazards.trial import run_trial
from capsafe.sim import SimBackend
from capsafe.sim.calibration import (
    ALLOCATION_GRANULARITY,
    DEVICE_ATTRIBUTES,
    DRIVER_VERSION,
    TOTAL_MEMORY,
)

N = 1 << 16


def result_of(fn: Callable[..., object], *args: object) -> str:
    with pytest.raises(CudaError) as info:
        fn(*args)
    return info.value.result


@pytest.mark.cuda
def test_sim_device_description_matches_the_gpu() -> None:
    from capsafe.backend_cuda import CudaBackend

    real = CudaBackend()
    real.init()
    dev = real.device_get(0)
    if "H200" not in real.device_get_name(dev):
        pytest.skip("the sim is calibrated against an H200")
    measured = {name: real.device_get_attribute(dev, name) for name in DEVICE_ATTRIBUTES}
    assert measured == DEVICE_ATTRIBUTES
    assert real.driver_version() == DRIVER_VERSION
    assert real.mem_get_allocation_granularity(dev) == ALLOCATION_GRANULARITY
    context = real.primary_ctx_retain(dev)
    real.ctx_set_current(context)
    try:
        assert real.mem_get_info()[1] == TOTAL_MEMORY
    finally:
        real.ctx_set_current(None)
        real.primary_ctx_release(dev)


def test_fill_copy_and_synchronized_read(backend: Backend) -> None:
    b = backend
    stream = b.stream_create(nonblocking=True)
    ptr = b.mem_alloc(N)
    b.memcpy_htod(ptr, bytes(range(256)) * (N // 256))
    b.memset_d8_async(ptr + 256, 0x7E, N - 512, stream)
    b.stream_synchronize(stream)
    out = bytearray(N)
    b.memcpy_dtoh(out, ptr)
    assert out[:256] == bytes(range(256)) == out[-256:]
    assert out[256:-256].count(0x7E) == N - 512
    b.mem_free(ptr)
    b.stream_destroy(stream)


def test_graph_capture_and_two_launches(backend: Backend) -> None:
    b = backend
    stream = b.stream_create(nonblocking=True)
    ptr = b.mem_alloc(N)
    b.memset_d8(ptr, 0, N)
    b.stream_begin_capture(stream, CaptureMode.THREAD_LOCAL)
    b.memset_d8_async(ptr, 0x3C, N, stream)
    graph = b.stream_end_capture(stream)
    exec_ = b.graph_instantiate(graph)
    out = bytearray(N)
    for _ in range(2):
        b.graph_launch(exec_, stream)
        b.stream_synchronize(stream)
        b.memcpy_dtoh(out, ptr)
        assert out.count(0x3C) == N
        b.memset_d8(ptr, 0, N)
    b.graph_exec_destroy(exec_)
    b.graph_destroy(graph)
    b.mem_free(ptr)
    b.stream_destroy(stream)


def test_error_names_match(backend: Backend) -> None:
    b = backend
    assert result_of(b.device_get, b.device_get_count()) == "CUDA_ERROR_INVALID_DEVICE"
    assert result_of(b.mem_alloc, 0) == "CUDA_ERROR_INVALID_VALUE"
    module = b.module_load_data(NOOP_PTX)
    assert b.module_get_function(module, NOOP_KERNEL).name == NOOP_KERNEL
    assert result_of(b.module_get_function, module, "no_such_kernel") == "CUDA_ERROR_NOT_FOUND"
    b.module_unload(module)
    newer = NOOP_PTX.replace(b".version 8.0", b".version 9.5")
    assert result_of(b.module_load_data, newer) == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
    assert result_of(b.stream_begin_capture, LEGACY_STREAM, CaptureMode.GLOBAL) == (
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    )
    stream = b.stream_create()
    b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    assert result_of(b.stream_begin_capture, stream, CaptureMode.GLOBAL) == (
        "CUDA_ERROR_ILLEGAL_STATE"
    )
    assert result_of(b.ctx_synchronize) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    with pytest.raises(CaptureInvalidated):
        b.stream_end_capture(stream)
    b.stream_destroy(stream)


def test_a_thread_without_a_context_gets_invalid_context(backend: Backend) -> None:
    seen: list[str] = []

    def unbound() -> None:
        try:
            backend.mem_alloc(16)
            seen.append("CUDA_SUCCESS")
        except CudaError as exc:
            seen.append(exc.result)

    worker = threading.Thread(target=unbound)
    worker.start()
    worker.join(30)
    assert seen == ["CUDA_ERROR_INVALID_CONTEXT"]


@pytest.mark.parametrize(
    "cell",
    [
        ("noop", "global", "nonblocking", "other_thread"),
        ("mem_alloc", "global", "nonblocking", "other_thread"),
        ("mem_alloc", "relaxed", "blocking", "same_thread"),
        ("memcpy_dtoh", "thread_local", "blocking", "other_thread"),
        ("vmm_unmap", "global", "blocking", "same_thread"),
        ("primary_ctx_release_retain", "global", "nonblocking", "same_thread"),
    ],
    ids="-".join,
)
def test_hazard_trial_in_process(backend: Backend, cell: tuple[str, str, str, str]) -> None:
    """The hazard-matrix actions run on both drivers and give the table's answer."""
    assert run_trial(backend, *cell, timeout=30).outcome == hazards.expected(*cell)


def test_the_sim_refuses_what_the_gpu_refuses_from_nvrtc_13_5() -> None:
    """NVRTC 13.5 writes `.version 9.5`; driver 580 (CUDA 13.0) reads up to 9.0."""
    b = SimBackend()
    b.init()
    b.ctx_set_current(b.primary_ctx_retain(b.device_get(0)))
    for version, loads in ((b"8.0", True), (b"9.0", True), (b"9.1", False), (b"9.5", False)):
        image = NOOP_PTX.replace(b".version 8.0", b".version " + version)
        if loads:
            b.module_load_data(image)
        else:
            assert result_of(b.module_load_data, image) == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
