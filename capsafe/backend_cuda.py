"""The real driver (and NVRTC) through cuda.bindings.

This is the only module in the project that imports cuda.bindings. Everything
else talks to `capsafe.backend.Backend` (driver) or to the NVRTC functions at
the bottom of this file, so a driver or bindings upgrade touches one file.
cuda.bindings is imported lazily: importing capsafe must work without it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from capsafe.backend import (
    Backend,
    Dim3,
    KernelArg,
    check_kernel_args,
    host_view,
    is_binary_image,
)
from capsafe.errors import CapsafeError, UsageError, cuda_error
from capsafe.handles import (
    CaptureMode,
    CaptureStatus,
    Context,
    Device,
    DevicePtr,
    Event,
    Function,
    Graph,
    GraphExec,
    HostPtr,
    MemHandle,
    Module,
    Stream,
    StreamKind,
)

# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def _driver_module() -> Any:
    # cuda.bindings ships no type information (no py.typed, no stubs).
    from cuda.bindings import driver  # type: ignore[import-untyped]

    return driver


@functools.cache
def unavailable_reason() -> str | None:
    """Why the real driver cannot run here, or None when it can (cached; never raises).

    Checks, in order: cuda.bindings imports, the driver library loads, cuInit(0)
    succeeds and at least one device answers.
    """
    try:
        drv = _driver_module()
    except Exception:
        return (
            "cuda-bindings is not installed (the cuda extra: pip install -e '.[cuda]' in a "
            "capsafe checkout)"
        )
    try:
        (err,) = drv.cuInit(0)
    except Exception:  # cuda.pathfinder's DynamicLibNotFoundError and kin
        return "no NVIDIA driver found (libcuda could not be loaded)"
    try:
        if err == drv.CUresult.CUDA_ERROR_NO_DEVICE:
            return "driver found but no CUDA device"
        if err != drv.CUresult.CUDA_SUCCESS:
            return f"the NVIDIA driver did not initialize (cuInit: {err.name})"
        err, count = drv.cuDeviceGetCount()
        if err != drv.CUresult.CUDA_SUCCESS or count < 1:
            return "driver found but no CUDA device"
    except Exception as exc:
        return f"the NVIDIA driver did not answer ({type(exc).__name__}: {exc})"
    return None


def bindings_version() -> str | None:
    """The installed cuda-bindings version, or None when it is not installed."""
    try:
        from cuda.bindings import __version__
    except Exception:
        return None
    return str(__version__)


_CAPTURE_STATUS = {
    "CU_STREAM_CAPTURE_STATUS_NONE": CaptureStatus.NONE,
    "CU_STREAM_CAPTURE_STATUS_ACTIVE": CaptureStatus.ACTIVE,
    "CU_STREAM_CAPTURE_STATUS_INVALIDATED": CaptureStatus.INVALIDATED,
}


def _host_arg(view: memoryview) -> Any:
    """What cuda.bindings accepts as a host pointer: the address for writable views."""
    if view.readonly:
        return view  # the bindings take the buffer protocol
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0


class _KernelParams:
    """The void** array cuLaunchKernel reads, plus the storage it points into."""

    def __init__(self, args: Sequence[KernelArg]) -> None:
        self.storage: list[ctypes._SimpleCData[Any]] = [
            ctypes.c_void_p(arg.value) if isinstance(arg, DevicePtr) else arg
            for arg in check_kernel_args(args)
        ]
        self.array = (ctypes.c_void_p * max(len(self.storage), 1))(
            *(ctypes.addressof(value) for value in self.storage)
        )

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array) if self.storage else 0


class CudaBackend(Backend):
    """The Backend interface over the real driver (cuda.bindings.driver)."""

    name = "cuda"

    def __init__(self) -> None:
        self._drv = _driver_module()
        self._ok = self._drv.CUresult.CUDA_SUCCESS

    def _call(self, symbol: str, *args: Any, detail: str = "") -> Any:
        """Call a driver symbol; raise CudaError unless it returned CUDA_SUCCESS.

        Returns nothing, the one output value, or a tuple of them.
        """
        err, *values = getattr(self._drv, symbol)(*args)
        if err != self._ok:
            raise cuda_error(err.name, symbol, detail)
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _ready(self, symbol: str, handle: Any) -> bool:
        """cuStreamQuery / cuEventQuery: NOT_READY is an answer, not an error."""
        (err,) = getattr(self._drv, symbol)(handle)
        if err == self._ok:
            return True
        if err == self._drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise cuda_error(err.name, symbol)

    def _stream(self, stream: Stream) -> Any:
        return stream.raw if stream.raw is not None else self._drv.CUstream(stream.value)

    def _device(self, device: Device) -> Any:
        return device.raw if device.raw is not None else self._drv.CUdevice(device.value)

    def _ptr(self, ptr: DevicePtr) -> Any:
        return self._drv.CUdeviceptr(ptr.value)

    def _location(self, device: Device) -> Any:
        location = self._drv.CUmemLocation()
        location.type = self._drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = device.ordinal
        return location

    def _pinned_prop(self, device: Device) -> Any:
        prop = self._drv.CUmemAllocationProp()
        prop.type = self._drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = self._location(device)
        return prop

    # -- init and devices ---------------------------------------------------
    def init(self) -> None:
        self._call("cuInit", 0)

    def driver_version(self) -> int:
        return int(self._call("cuDriverGetVersion"))

    def device_get_count(self) -> int:
        return int(self._call("cuDeviceGetCount"))

    def device_get(self, ordinal: int) -> Device:
        dev = self._call("cuDeviceGet", ordinal, detail=f"ordinal {ordinal}")
        return Device(int(dev), raw=dev, ordinal=ordinal)

    def device_get_name(self, device: Device) -> str:
        name = self._call("cuDeviceGetName", 256, self._device(device))
        return bytes(name).split(b"\0", 1)[0].decode(errors="replace").strip()

    def device_get_attribute(self, device: Device, attribute: str) -> int:
        enum = self._drv.CUdevice_attribute
        member = getattr(enum, f"CU_DEVICE_ATTRIBUTE_{attribute.upper()}", None)
        if member is None:
            raise UsageError(
                f"unknown device attribute {attribute!r} (CU_DEVICE_ATTRIBUTE_ suffix)"
            )
        return int(
            self._call("cuDeviceGetAttribute", member, self._device(device), detail=attribute)
        )

    # -- contexts -----------------------------------------------------------
    def primary_ctx_retain(self, device: Device) -> Context:
        ctx = self._call("cuDevicePrimaryCtxRetain", self._device(device))
        return Context(int(ctx), raw=ctx)

    def primary_ctx_release(self, device: Device) -> None:
        self._call("cuDevicePrimaryCtxRelease", self._device(device))

    def ctx_set_current(self, context: Context | None) -> None:
        raw = self._drv.CUcontext(0) if context is None else context.raw
        self._call("cuCtxSetCurrent", raw)

    def ctx_get_current(self) -> Context | None:
        ctx = self._call("cuCtxGetCurrent")
        return None if int(ctx) == 0 else Context(int(ctx), raw=ctx)

    def ctx_synchronize(self) -> None:
        self._call("cuCtxSynchronize")

    # -- streams and capture ------------------------------------------------
    def stream_create(self, nonblocking: bool = True) -> Stream:
        flags = self._drv.CUstream_flags
        flag = flags.CU_STREAM_NON_BLOCKING if nonblocking else flags.CU_STREAM_DEFAULT
        stream = self._call("cuStreamCreate", int(flag))
        kind = StreamKind.NONBLOCKING if nonblocking else StreamKind.BLOCKING
        return Stream(int(stream), raw=stream, kind=kind)

    def stream_destroy(self, stream: Stream) -> None:
        self._call("cuStreamDestroy", self._stream(stream))

    def stream_synchronize(self, stream: Stream) -> None:
        self._call("cuStreamSynchronize", self._stream(stream))

    def stream_query(self, stream: Stream) -> bool:
        return self._ready("cuStreamQuery", self._stream(stream))

    def stream_is_capturing(self, stream: Stream) -> CaptureStatus:
        status = self._call("cuStreamIsCapturing", self._stream(stream))
        return _CAPTURE_STATUS[status.name]

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._call("cuStreamWaitEvent", self._stream(stream), event.raw, 0)

    def stream_begin_capture(self, stream: Stream, mode: CaptureMode) -> None:
        mode = CaptureMode.parse(mode)
        member = getattr(self._drv.CUstreamCaptureMode, f"CU_STREAM_CAPTURE_MODE_{mode.name}")
        self._call("cuStreamBeginCapture", self._stream(stream), member, detail=mode.name)

    def stream_end_capture(self, stream: Stream) -> Graph:
        graph = self._call("cuStreamEndCapture", self._stream(stream))
        return Graph(int(graph), raw=graph)

    def graph_instantiate(self, graph: Graph) -> GraphExec:
        graph_exec = self._call("cuGraphInstantiate", graph.raw, 0)
        return GraphExec(int(graph_exec), raw=graph_exec)

    def graph_launch(self, graph_exec: GraphExec, stream: Stream) -> None:
        self._call("cuGraphLaunch", graph_exec.raw, self._stream(stream))

    def graph_exec_destroy(self, graph_exec: GraphExec) -> None:
        self._call("cuGraphExecDestroy", graph_exec.raw)

    def graph_destroy(self, graph: Graph) -> None:
        self._call("cuGraphDestroy", graph.raw)

    # -- events -------------------------------------------------------------
    def event_create(self, timing: bool = False) -> Event:
        flags = self._drv.CUevent_flags
        flag = flags.CU_EVENT_DEFAULT if timing else flags.CU_EVENT_DISABLE_TIMING
        event = self._call("cuEventCreate", int(flag))
        return Event(int(event), raw=event)

    def event_record(self, event: Event, stream: Stream) -> None:
        self._call("cuEventRecord", event.raw, self._stream(stream))

    def event_synchronize(self, event: Event) -> None:
        self._call("cuEventSynchronize", event.raw)

    def event_query(self, event: Event) -> bool:
        return self._ready("cuEventQuery", event.raw)

    def event_destroy(self, event: Event) -> None:
        self._call("cuEventDestroy", event.raw)

    # -- memory -------------------------------------------------------------
    # mem_alloc / mem_free are a memory pool's growth path (CuPy's, through
    # capsafe.integrations.cupy): called directly, without _call's generic unpacking,
    # and the pointer cuMemAlloc returned is handed back as it is.
    def mem_alloc(self, size: int) -> DevicePtr:
        err, ptr = self._drv.cuMemAlloc(size)
        if err != self._ok:
            raise cuda_error(err.name, "cuMemAlloc", f"{size} bytes")
        return DevicePtr(int(ptr), raw=ptr, size=size)

    def mem_free(self, ptr: DevicePtr) -> None:
        (err,) = self._drv.cuMemFree(ptr.value if ptr.raw is None else ptr.raw)
        if err != self._ok:
            raise cuda_error(err.name, "cuMemFree")

    def mem_alloc_async(self, size: int, stream: Stream) -> DevicePtr:
        ptr = self._call("cuMemAllocAsync", size, self._stream(stream), detail=f"{size} bytes")
        return DevicePtr(int(ptr), raw=ptr, size=size)

    def mem_free_async(self, ptr: DevicePtr, stream: Stream) -> None:
        self._call("cuMemFreeAsync", self._ptr(ptr), self._stream(stream))

    def mem_host_alloc(self, size: int) -> HostPtr:
        address = int(self._call("cuMemHostAlloc", size, 0, detail=f"{size} bytes"))
        view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
        return HostPtr(address, size=size, buffer=view)

    def mem_free_host(self, ptr: HostPtr) -> None:
        self._call("cuMemFreeHost", ptr.value)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("cuMemGetInfo")
        return int(free), int(total)

    def memcpy_htod(self, dst: DevicePtr, src: Any) -> None:
        view = host_view(src, writable=False)
        self._call("cuMemcpyHtoD", self._ptr(dst), _host_arg(view), view.nbytes)

    def memcpy_dtoh(self, dst: Any, src: DevicePtr, size: int | None = None) -> None:
        view = host_view(dst, writable=True)
        count = view.nbytes if size is None else size
        self._check_fits(count, view)
        self._call("cuMemcpyDtoH", _host_arg(view), self._ptr(src), count)

    def memcpy_htod_async(self, dst: DevicePtr, src: Any, stream: Stream) -> None:
        view = host_view(src, writable=False)
        self._call(
            "cuMemcpyHtoDAsync", self._ptr(dst), _host_arg(view), view.nbytes, self._stream(stream)
        )

    def memcpy_dtoh_async(
        self, dst: Any, src: DevicePtr, stream: Stream, size: int | None = None
    ) -> None:
        view = host_view(dst, writable=True)
        count = view.nbytes if size is None else size
        self._check_fits(count, view)
        self._call(
            "cuMemcpyDtoHAsync", _host_arg(view), self._ptr(src), count, self._stream(stream)
        )

    @staticmethod
    def _check_fits(count: int, view: memoryview) -> None:
        if count > view.nbytes:
            raise UsageError(f"cannot copy {count} bytes into a {view.nbytes}-byte host buffer")

    def memset_d8(self, ptr: DevicePtr, value: int, count: int) -> None:
        self._call("cuMemsetD8", self._ptr(ptr), value, count)

    def memset_d8_async(self, ptr: DevicePtr, value: int, count: int, stream: Stream) -> None:
        self._call("cuMemsetD8Async", self._ptr(ptr), value, count, self._stream(stream))

    # -- modules and kernels ------------------------------------------------
    def module_load_data(self, image: bytes) -> Module:
        image = bytes(image)
        if not is_binary_image(image) and not image.endswith(b"\0"):
            image += b"\0"  # PTX is read as a C string
        module = self._call("cuModuleLoadData", image)
        return Module(int(module), raw=module)

    def module_get_function(self, module: Module, name: str) -> Function:
        function = self._call("cuModuleGetFunction", module.raw, name.encode(), detail=name)
        return Function(int(function), raw=function, name=name, module=module)

    def module_unload(self, module: Module) -> None:
        self._call("cuModuleUnload", module.raw)

    def launch_kernel(
        self,
        function: Function,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        stream: Stream,
        shared_mem: int = 0,
    ) -> None:
        params = _KernelParams(args)
        self._call(
            "cuLaunchKernel",
            function.raw,
            *grid,
            *block,
            shared_mem,
            self._stream(stream),
            params.address,
            0,
            detail=function.name,
        )

    # -- virtual memory management -----------------------------------------
    def mem_get_allocation_granularity(self, device: Device) -> int:
        option = self._drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._call("cuMemGetAllocationGranularity", self._pinned_prop(device), option))

    def mem_create(self, size: int, device: Device) -> MemHandle:
        handle = self._call(
            "cuMemCreate", size, self._pinned_prop(device), 0, detail=f"{size} bytes"
        )
        return MemHandle(int(handle), raw=handle, size=size)

    def mem_address_reserve(self, size: int, alignment: int = 0) -> DevicePtr:
        ptr = self._call("cuMemAddressReserve", size, alignment, 0, 0, detail=f"{size} bytes")
        return DevicePtr(int(ptr), raw=ptr, size=size)

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        self._call("cuMemMap", self._ptr(ptr), size, 0, handle.raw, 0)

    def mem_set_access(self, ptr: DevicePtr, size: int, device: Device) -> None:
        access = self._drv.CUmemAccessDesc()
        access.location = self._location(device)
        access.flags = self._drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._call("cuMemSetAccess", self._ptr(ptr), size, [access], 1)

    def mem_unmap(self, ptr: DevicePtr, size: int) -> None:
        self._call("cuMemUnmap", self._ptr(ptr), size)

    def mem_release(self, handle: MemHandle) -> None:
        self._call("cuMemRelease", handle.raw)

    def mem_address_free(self, ptr: DevicePtr, size: int) -> None:
        self._call("cuMemAddressFree", self._ptr(ptr), size)


# ---------------------------------------------------------------------------
# NVRTC: runs on the CPU (the nvidia-cuda-nvrtc wheel); no GPU or driver needed.
# ---------------------------------------------------------------------------


class NvrtcUnavailable(CapsafeError, RuntimeError):
    """cuda-bindings or the NVRTC library is not installed."""


class NvrtcCompileError(CapsafeError, RuntimeError):
    """NVRTC rejected the source; `log` is NVRTC's own compile log."""

    def __init__(self, name: str, result: str, log: str) -> None:
        self.name, self.result, self.log = name, result, log
        super().__init__(f"NVRTC could not compile {name}: {result}\n{log}".rstrip())


@dataclass(frozen=True)
class NvrtcOutput:
    image: bytes  # PTX text (NUL-terminated, as NVRTC returns it) or a CUBIN
    log: str


@functools.cache
def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise NvrtcUnavailable(
            f"NVRTC needs cuda-bindings and nvidia-cuda-nvrtc ({exc}); "
            "install them with the cuda extra: pip install -e '.[cuda]' in a capsafe checkout"
        ) from exc
    return nvrtc


def _nvrtc_check(result: Any, call: str) -> None:
    if int(result) != 0:
        raise NvrtcUnavailable(f"{call} failed: {result.name}")


#: The NVRTC (size, fetch) calls that return each artifact kind.
_NVRTC_IMAGE_GETTERS = {
    "ptx": ("nvrtcGetPTXSize", "nvrtcGetPTX"),
    "cubin": ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
}


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that will compile."""
    nvrtc = _nvrtc()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the library itself failed to load
        raise NvrtcUnavailable(f"the NVRTC library could not be loaded: {exc}") from exc
    _nvrtc_check(err, "nvrtcVersion")
    return major, minor


def nvrtc_compile(
    source: str,
    name: str,
    options: Sequence[str],
    headers: Mapping[str, str],
    kind: str,
) -> NvrtcOutput:
    """Compile one translation unit to `kind` ("ptx" or "cubin")."""
    getters = _NVRTC_IMAGE_GETTERS.get(kind)
    if getters is None:
        raise UsageError(f"kind must be one of {', '.join(_NVRTC_IMAGE_GETTERS)}, not {kind!r}")
    size_symbol, image_symbol = getters
    nvrtc = _nvrtc()
    names = [h.encode() for h in headers]
    bodies = [headers[h].encode() for h in headers]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), len(names), bodies, names)
    _nvrtc_check(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _nvrtc_check(err, "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffers it is given: never hand it a bytes object. `b" " * 1`
        # (an empty log is one NUL) is the interpreter's shared b" ", and writing it turned
        # every b" " of the process into b"\0" (found by sweeping our own tests).
        log = bytearray(size)
        (err,) = nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.rstrip(b"\0").decode(errors="replace").strip()
        if int(result) != 0:
            raise NvrtcCompileError(name, result.name, log_text)
        err, size = getattr(nvrtc, size_symbol)(prog)
        _nvrtc_check(err, size_symbol)
        image = bytearray(size)
        (err,) = getattr(nvrtc, image_symbol)(prog, image)
        _nvrtc_check(err, image_symbol)
        return NvrtcOutput(image=bytes(image), log=log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
