"""The sim as a driver: init, devices, per-thread contexts, handles, modules, kernels, threads."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from capsafe.backend import Dim3
from capsafe.config import MAX_SIM_DEVICES
from capsafe.errors import CudaError, UsageError
from capsafe.handles import Device, Event, Function, Handle, Module, Stream
from capsafe.sim import (
    KernelStandIn,
    SimBackend,
    SimMemory,
    kernel_standin,
    register_kernel,
    unregister_kernel,
)
from capsafe.sim.calibration import DEVICE_NAME, DRIVER_VERSION

PTX = b"""\
.version 8.0
.target sm_90
.address_size 64
.visible .entry add_one(.param .u64 p, .param .u32 n)
{
\tret;
}
.entry helper()
{
\tret;
}
\x00"""


def result_of(fn: Callable[..., object], *args: object, **kwargs: object) -> str:
    with pytest.raises(CudaError) as info:
        fn(*args, **kwargs)
    return info.value.result


def test_calls_before_init_are_not_initialized() -> None:
    b = SimBackend()
    assert b.driver_version() == DRIVER_VERSION == 13000
    assert result_of(b.device_get_count) == "CUDA_ERROR_NOT_INITIALIZED"
    assert result_of(b.device_get, 0) == "CUDA_ERROR_NOT_INITIALIZED"
    b.init()
    b.init()  # idempotent
    assert b.device_get_count() == 1


def test_device_description_is_one_h200() -> None:
    b = SimBackend()
    b.init()
    dev = b.device_get(0)
    assert b.device_get_name(dev) == DEVICE_NAME
    attr = b.device_get_attribute
    assert (attr(dev, "COMPUTE_CAPABILITY_MAJOR"), attr(dev, "compute_capability_minor")) == (9, 0)
    assert attr(dev, "MULTIPROCESSOR_COUNT") == 132
    with pytest.raises(UsageError, match="does not model"):
        attr(dev, "NO_SUCH_ATTRIBUTE")


@pytest.mark.parametrize("ordinal", [1, 7, -1])
def test_out_of_range_ordinals_are_invalid_device(ordinal: int) -> None:
    b = SimBackend()
    b.init()
    assert result_of(b.device_get, ordinal) == "CUDA_ERROR_INVALID_DEVICE"
    assert result_of(b.primary_ctx_retain, Device(ordinal, ordinal=ordinal)) == (
        "CUDA_ERROR_INVALID_DEVICE"
    )


def test_several_devices_each_have_their_own_context_and_memory() -> None:
    b = SimBackend(devices=3)
    b.init()
    assert b.device_get_count() == 3
    devices = [b.device_get(n) for n in range(3)]
    assert [d.ordinal for d in devices] == [0, 1, 2]
    assert result_of(b.device_get, 3) == "CUDA_ERROR_INVALID_DEVICE"
    contexts = [b.primary_ctx_retain(d) for d in devices]
    assert len({c.value for c in contexts}) == 3
    b.ctx_set_current(contexts[0])
    ptr = b.mem_alloc(1 << 20)
    stream = b.stream_create()
    free0, total = b.mem_get_info()
    b.ctx_set_current(contexts[1])
    assert b.mem_get_info() == (total, total)  # device 1's memory is untouched
    assert result_of(b.mem_free, ptr) == "CUDA_ERROR_INVALID_VALUE"
    assert result_of(b.stream_synchronize, stream) == "CUDA_ERROR_INVALID_HANDLE"
    b.primary_ctx_release(devices[1])  # tearing down device 1 leaves device 0 alone
    b.ctx_set_current(contexts[0])
    assert b.mem_get_info() == (free0, total)
    b.mem_free(ptr)
    assert b.device_get_name(devices[2]) == DEVICE_NAME


@pytest.mark.parametrize("devices", [0, -1, 1.5, MAX_SIM_DEVICES + 1, 10**6])
def test_a_machine_without_devices_or_with_too_many_is_a_usage_error(devices: Any) -> None:
    """Above MAX_SIM_DEVICES the constructor refuses before building any device
    (10^6 devices took 7-10 s and 320 MB before the first call)."""
    with pytest.raises(UsageError, match=f"1 to {MAX_SIM_DEVICES} devices"):
        SimBackend(devices=devices)
    most = SimBackend(devices=MAX_SIM_DEVICES)
    most.init()
    assert most.device_get_count() == MAX_SIM_DEVICES


def test_context_is_per_thread(sim_backend: SimBackend) -> None:
    """A thread that never bound a context gets INVALID_CONTEXT, as on the driver."""
    b = sim_backend
    context = b.ctx_get_current()
    assert context is not None
    seen: dict[str, object] = {}

    def unbound() -> None:
        seen["current"] = b.ctx_get_current()
        try:
            b.mem_alloc(8)
        except CudaError as exc:
            seen["alloc"] = exc.result
        b.ctx_set_current(context)
        seen["after_bind"] = b.mem_alloc(8).size

    worker = threading.Thread(target=unbound)
    worker.start()
    worker.join(10)
    assert seen == {"current": None, "alloc": "CUDA_ERROR_INVALID_CONTEXT", "after_bind": 8}


def test_primary_context_refcount_and_teardown() -> None:
    b = SimBackend()
    b.init()
    dev = b.device_get(0)
    ctx = b.primary_ctx_retain(dev)
    assert b.primary_ctx_retain(dev) == ctx  # one primary context per device
    b.ctx_set_current(ctx)
    stream = b.stream_create()
    ptr = b.mem_alloc(1 << 20)
    out = bytearray(4)
    b.memset_d8_async(ptr, 1, 4, stream)
    b.memcpy_dtoh_async(out, ptr, stream)
    b.primary_ctx_release(dev)
    b.memcpy_dtoh(out, ptr)  # still alive at refcount 1
    b.primary_ctx_release(dev)  # refcount 0: synchronized, then torn down
    assert out == bytes([1]) * 4
    assert result_of(b.mem_alloc, 8) == "CUDA_ERROR_INVALID_CONTEXT"
    assert result_of(b.primary_ctx_release, dev) == "CUDA_ERROR_INVALID_CONTEXT"
    b.primary_ctx_retain(dev)  # a fresh context: the old handles are gone
    assert b.mem_get_info()[0] == b.mem_get_info()[1]
    assert result_of(b.stream_synchronize, stream) == "CUDA_ERROR_INVALID_HANDLE"
    assert result_of(b.mem_free, ptr) == "CUDA_ERROR_INVALID_VALUE"
    b.ctx_set_current(None)
    assert b.ctx_get_current() is None


@pytest.mark.parametrize(
    ("call", "handle"),
    [
        ("stream_synchronize", Stream(0x1234)),
        ("stream_destroy", Stream(0x1234)),
        ("event_synchronize", Event(0x1234)),
        ("event_destroy", Event(0x1234)),
        ("module_unload", Module(0x1234)),
        ("module_get_function", Module(0x1234)),
    ],
)
def test_unknown_handles_are_invalid_handle(
    sim_backend: SimBackend, call: str, handle: Handle
) -> None:
    args = (handle, "k") if call == "module_get_function" else (handle,)
    assert result_of(getattr(sim_backend, call), *args) == "CUDA_ERROR_INVALID_HANDLE"


def test_handles_of_the_wrong_type_are_a_usage_error(sim_backend: SimBackend) -> None:
    with pytest.raises(UsageError):
        an_event: Any = sim_backend.event_create()  # where a Stream belongs
        sim_backend.stream_synchronize(an_event)


# -- modules -----------------------------------------------------------------------------


def test_ptx_module_functions(sim_backend: SimBackend) -> None:
    b = sim_backend
    module = b.module_load_data(PTX)
    assert b.module_get_function(module, "add_one").name == "add_one"
    assert b.module_get_function(module, "helper").module == module
    assert result_of(b.module_get_function, module, "missing") == "CUDA_ERROR_NOT_FOUND"
    b.module_unload(module)
    assert result_of(b.module_unload, module) == "CUDA_ERROR_INVALID_HANDLE"


@pytest.mark.parametrize(
    ("image", "result"),
    [
        (b"", "CUDA_ERROR_INVALID_VALUE"),
        (b"\x00\x01\x02garbage", "CUDA_ERROR_INVALID_IMAGE"),
        (b".target sm_90\n.entry k() { ret; }", "CUDA_ERROR_INVALID_PTX"),
        (PTX.replace(b".version 8.0", b".version 9.5"), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
        (PTX.replace(b".version 8.0", b".version 10.0"), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
    ],
    ids=["empty", "binary-garbage", "no-version", "ptx-9.5", "ptx-10.0"],
)
def test_bad_images_are_refused(sim_backend: SimBackend, image: bytes, result: str) -> None:
    assert result_of(sim_backend.module_load_data, image) == result


def test_ptx_9_0_is_the_newest_accepted(sim_backend: SimBackend) -> None:
    sim_backend.module_load_data(PTX.replace(b".version 8.0", b".version 9.0"))


def test_nvrtc_13_5_ptx_is_refused_and_its_cubin_loads(sim_backend: SimBackend) -> None:
    """Calibrated: driver 580 (CUDA 13.0) refuses the PTX that NVRTC 13.5 emits."""
    nvrtc = pytest.importorskip("capsafe.backend_cuda")
    try:
        nvrtc.nvrtc_version()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(str(exc))
    src = 'extern "C" __global__ void fill7(char* p) { p[threadIdx.x] = 7; }'
    ptx = nvrtc.nvrtc_compile(src, "fill7.cu", ["-arch=compute_90"], {}, "ptx").image
    if b".version 9.0" in ptx or b".version 8." in ptx:
        pytest.skip("this NVRTC emits PTX the driver accepts")
    assert result_of(sim_backend.module_load_data, ptx) == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
    cubin = nvrtc.nvrtc_compile(src, "fill7.cu", ["-arch=sm_90"], {}, "cubin").image
    module = sim_backend.module_load_data(cubin)
    assert sim_backend.module_get_function(module, "fill7").name == "fill7"
    assert result_of(sim_backend.module_get_function, module, "fill") == "CUDA_ERROR_NOT_FOUND"


# -- kernels -------------------------------------------------------------------------------


def add_one(memory: SimMemory, grid: Dim3, block: Dim3, args: Sequence[Any]) -> None:
    ptr, n = args
    data = bytearray(memory.read(ptr, n.value))
    memory.write(ptr, bytes((x + 1) % 256 for x in data))


def test_kernel_standin_runs_when_the_launch_executes(
    sim_backend: SimBackend, sim_kernel: Callable[[str, KernelStandIn], KernelStandIn]
) -> None:
    b = sim_backend
    sim_kernel("add_one", add_one)
    fn = b.module_get_function(b.module_load_data(PTX), "add_one")
    stream = b.stream_create()
    ptr = b.mem_alloc(4)
    b.memcpy_htod(ptr, b"\x00\x01\x02\xff")
    b.launch_kernel(fn, (1, 1, 1), (4, 1, 1), [ptr, ctypes.c_uint32(4)], stream)
    out = bytearray(4)
    b.memcpy_dtoh(out, ptr)
    assert out == b"\x00\x01\x02\xff"  # not yet: nothing waited on the stream
    b.stream_synchronize(stream)
    b.memcpy_dtoh(out, ptr)
    assert out == b"\x01\x02\x03\x00"


def test_unregistered_kernels_are_opaque_and_helper_has_no_standin(
    sim_backend: SimBackend,
) -> None:
    b = sim_backend
    fn = b.module_get_function(b.module_load_data(PTX), "helper")
    b.launch_kernel(fn, (1, 1, 1), (1, 1, 1), [], b.stream_create())
    b.ctx_synchronize()


def test_registration_forms_and_cleanup() -> None:
    b = SimBackend()
    b.init()
    b.ctx_set_current(b.primary_ctx_retain(b.device_get(0)))
    fn = b.module_get_function(b.module_load_data(PTX), "helper")
    stream = b.stream_create()
    calls: list[str] = []

    try:
        decorator: Callable[[KernelStandIn], KernelStandIn] = register_kernel("helper")

        @decorator
        def outer(memory: SimMemory, grid: Dim3, block: Dim3, args: Sequence[Any]) -> None:
            calls.append("outer")

        with kernel_standin("helper", lambda *_: calls.append("inner")):
            b.launch_kernel(fn, (1, 1, 1), (1, 1, 1), [], stream)
            b.stream_synchronize(stream)
        b.launch_kernel(fn, (1, 1, 1), (1, 1, 1), [], stream)  # the outer one is back
        b.stream_synchronize(stream)
    finally:
        unregister_kernel("helper")
    unregister_kernel("helper")  # forgetting twice is harmless
    b.launch_kernel(fn, (1, 1, 1), (1, 1, 1), [], stream)
    b.stream_synchronize(stream)
    assert calls == ["inner", "outer"]


def test_standin_failures_surface_at_the_wait(
    sim_backend: SimBackend, sim_kernel: Callable[[str, KernelStandIn], KernelStandIn]
) -> None:
    b = sim_backend

    def out_of_bounds(memory: SimMemory, grid: Dim3, block: Dim3, args: Sequence[Any]) -> None:
        memory.write(args[0] + 2, b"toolong")

    def broken(memory: SimMemory, grid: Dim3, block: Dim3, args: Sequence[Any]) -> None:
        raise ValueError("bug in the stand-in")

    module = b.module_load_data(PTX)
    stream = b.stream_create()
    ptr = b.mem_alloc(4)
    for name, fn, result in (
        ("add_one", out_of_bounds, "CUDA_ERROR_ILLEGAL_ADDRESS"),
        ("helper", broken, "CUDA_ERROR_LAUNCH_FAILED"),
    ):
        sim_kernel(name, fn)
        b.launch_kernel(b.module_get_function(module, name), (1, 1, 1), (1, 1, 1), [ptr], stream)
        assert result_of(b.stream_synchronize, stream) == result


def test_context_teardown_completes_even_when_a_standin_fails(
    sim_kernel: Callable[[str, KernelStandIn], KernelStandIn],
) -> None:
    b = SimBackend()
    b.init()
    dev = b.device_get(0)
    b.ctx_set_current(b.primary_ctx_retain(dev))

    def broken(memory: SimMemory, grid: Dim3, block: Dim3, args: Sequence[Any]) -> None:
        raise RuntimeError("boom")

    sim_kernel("helper", broken)
    fn = b.module_get_function(b.module_load_data(PTX), "helper")
    b.launch_kernel(fn, (1, 1, 1), (1, 1, 1), [], b.stream_create())
    assert result_of(b.primary_ctx_release, dev) == "CUDA_ERROR_LAUNCH_FAILED"
    assert result_of(b.mem_alloc, 8) == "CUDA_ERROR_INVALID_CONTEXT"
    b.primary_ctx_retain(dev)
    b.mem_alloc(8)


def test_launch_limits_and_argument_types(sim_backend: SimBackend) -> None:
    b = sim_backend
    fn = b.module_get_function(b.module_load_data(PTX), "helper")
    stream = b.stream_create()
    for grid, block, shared in (
        ((1, 1, 1), (1025, 1, 1), 0),
        ((0, 1, 1), (1, 1, 1), 0),
        ((1, 1, 1), (32, 32, 2), 0),
        ((1, 1, 1), (1, 1, 1), 64 << 10),
    ):
        assert (
            result_of(b.launch_kernel, fn, grid, block, [], stream, shared_mem=shared)
            == "CUDA_ERROR_INVALID_VALUE"
        )
    not_an_argument: Any = 3
    with pytest.raises(UsageError):
        b.launch_kernel(fn, (1, 1, 1), (1, 1, 1), [not_an_argument], stream)
    assert fn.module is not None
    b.module_unload(fn.module)
    assert result_of(b.launch_kernel, fn, (1, 1, 1), (1, 1, 1), [], stream) == (
        "CUDA_ERROR_INVALID_HANDLE"
    )
    assert (
        result_of(b.launch_kernel, Function(0x99, name="x"), (1, 1, 1), (1, 1, 1), [], stream)
        == "CUDA_ERROR_INVALID_HANDLE"
    )


# -- threads and fork ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_many_threads_allocate_copy_and_free_concurrently(sim_backend: SimBackend) -> None:
    b = sim_backend
    context = b.ctx_get_current()
    free0 = b.mem_get_info()[0]
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            b.ctx_set_current(context)
            stream = b.stream_create(nonblocking=index % 2 == 0)
            for round_ in range(40):
                payload = bytes([index, round_]) * 64
                ptr = b.mem_alloc(len(payload))
                b.memcpy_htod_async(ptr, payload, stream)
                out = bytearray(len(payload))
                b.memcpy_dtoh_async(out, ptr, stream)
                b.stream_synchronize(stream)
                assert out == payload
                b.mem_free(ptr)
            b.stream_destroy(stream)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert errors == []
    assert b.mem_get_info()[0] == free0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_keeps_using_the_sim(sim_backend: SimBackend) -> None:
    b = sim_backend
    ptr = b.mem_alloc(4)
    b.memcpy_htod(ptr, b"fork")
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether the data and calls work
        try:
            out = bytearray(4)
            b.memcpy_dtoh(out, ptr)
            b.mem_free(b.mem_alloc(8))
            os._exit(0 if out == b"fork" else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
