"""`SimBackend`: the Backend interface over the simulated devices.

Each method checks, in the driver's order, that the backend is initialized,
that the calling thread has a current context, and whether the hazard table
says the call breaks an open capture; then it works on the current context's
memory (`memory`), streams (`streams`), captures and graphs (`capture`) and
modules (`kernels`).

All state sits behind one re-entrant lock; nothing in the sim ever blocks while
holding it, so many threads may call at once.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from capsafe import _state
from capsafe.backend import Backend, Dim3, KernelArg, check_kernel_args
from capsafe.config import MAX_SIM_DEVICES
from capsafe.errors import CudaError, UsageError, cuda_error
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
    Handle,
    HostPtr,
    MemHandle,
    Module,
    Stream,
    StreamKind,
)
from capsafe.sim import capture
from capsafe.sim.calibration import (
    ALLOCATION_GRANULARITY,
    DEVICE_ATTRIBUTES,
    DEVICE_NAME,
    DRIVER_VERSION,
    TOTAL_MEMORY,
)
from capsafe.sim.capture import Capture, Captures, GraphData
from capsafe.sim.kernels import ModuleState, SimMemory, check_launch, parse_image, standin
from capsafe.sim.memory import (
    AddressSpace,
    Alloc,
    ContextMemory,
    Mapping,
    Reservation,
    read_spans,
    write_spans,
)
from capsafe.sim.streams import (
    ContextStreams,
    EventState,
    Node,
    StreamState,
    drain,
    no_work,
    nothing,
)

_HANDLE_BASE = 0x5500_0000_0000  # streams, events, modules, graphs: fake driver pointers

T = TypeVar("T")


class _Context:
    """Everything a primary context owns; dropped whole when its refcount reaches zero."""

    def __init__(self, handle: Context, addresses: AddressSpace, seq: itertools.count[int]):
        self.handle = handle
        self.memory = ContextMemory(addresses)
        self.streams = ContextStreams(seq)
        self.captures: Captures = {}
        self.events: dict[int, EventState] = {}
        self.modules: dict[int, ModuleState] = {}
        self.functions: dict[int, tuple[int, str]] = {}
        self.graphs: dict[int, GraphData] = {}
        self.execs: dict[int, GraphData] = {}


@dataclass(eq=False)
class _DeviceState:
    handle: Device
    context_handle: Context
    refcount: int = 0
    context: _Context | None = None


_live: weakref.WeakSet[SimBackend] = weakref.WeakSet()


class SimBackend(Backend):
    """Simulated H200s (`devices` of them, default one). Each instance is a separate driver."""

    name = "sim"

    def __init__(self, devices: int = 1) -> None:
        if not isinstance(devices, int) or not 1 <= devices <= MAX_SIM_DEVICES:
            raise UsageError(
                f"the simulated machine has 1 to {MAX_SIM_DEVICES} devices, not {devices!r}"
            )
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._initialized = False
        self._ids = itertools.count(_HANDLE_BASE, 0x10)
        self._seq = itertools.count(1)
        self._addresses = AddressSpace()
        self._devices = [
            _DeviceState(Device(n, ordinal=n), Context(next(self._ids))) for n in range(devices)
        ]
        _live.add(self)

    # -- entry checks ---------------------------------------------------------
    def _ready(self, symbol: str) -> None:
        if not self._initialized:
            raise cuda_error("CUDA_ERROR_NOT_INITIALIZED", symbol, "call init() first")

    def _enter(self, method: str, symbol: str, stream: Stream | None = None) -> _Context:
        """Check init, the calling thread's context and the capture table; return the context."""
        self._ready(symbol)
        ctx = self._current(symbol)
        capture.apply_hazards(self._captures(), method, symbol, stream, ctx.handle.value)
        return ctx

    def _current(self, symbol: str) -> _Context:
        handle = getattr(self._tls, "context", None)
        if handle is None:
            raise cuda_error(
                "CUDA_ERROR_INVALID_CONTEXT",
                symbol,
                "no context is current on this thread; call ctx_set_current first",
            )
        for device in self._devices:
            if device.context_handle.value == handle.value:
                if device.context is None:
                    raise cuda_error(
                        "CUDA_ERROR_INVALID_CONTEXT",
                        symbol,
                        "the current primary context was released to refcount 0",
                    )
                return device.context
        raise cuda_error("CUDA_ERROR_INVALID_CONTEXT", symbol)

    def _captures(self) -> Iterator[Capture]:
        # Kept per context at capture begin and end, so a call never scans every stream.
        for device in self._devices:
            if device.context is not None:
                yield from device.context.captures.values()

    # -- lookups ----------------------------------------------------------------
    def _device(self, device: Device, symbol: str) -> _DeviceState:
        if not isinstance(device, Device):
            raise UsageError(f"{symbol}: expected a Device, got {type(device).__name__}")
        if not 0 <= device.ordinal < len(self._devices):
            raise cuda_error("CUDA_ERROR_INVALID_DEVICE", symbol, f"ordinal {device.ordinal}")
        return self._devices[device.ordinal]

    def _stream(self, ctx: _Context, stream: Stream, symbol: str) -> StreamState:
        if not isinstance(stream, Stream):
            raise UsageError(f"{symbol}: expected a Stream, got {type(stream).__name__}")
        if stream.value == 0:
            return ctx.streams.legacy
        ss = ctx.streams.created.get(stream.value)
        if ss is None:
            raise cuda_error("CUDA_ERROR_INVALID_HANDLE", symbol, f"stream {stream.value:#x}")
        return ss

    @staticmethod
    def _lookup(table: dict[int, T], handle: Handle, kind: type[Handle], symbol: str) -> T:
        if not isinstance(handle, kind):
            raise UsageError(f"{symbol}: expected a {kind.__name__}, got {type(handle).__name__}")
        found = table.get(handle.value)
        if found is None:
            raise cuda_error(
                "CUDA_ERROR_INVALID_HANDLE", symbol, f"{kind.__name__.lower()} {handle.value:#x}"
            )
        return found

    # -- init and devices -------------------------------------------------------
    def init(self) -> None:
        with self._lock:
            self._initialized = True

    def driver_version(self) -> int:
        return DRIVER_VERSION

    def device_get_count(self) -> int:
        with self._lock:
            self._ready("cuDeviceGetCount")
            return len(self._devices)

    def device_get(self, ordinal: int) -> Device:
        with self._lock:
            self._ready("cuDeviceGet")
            if not 0 <= ordinal < len(self._devices):
                raise cuda_error(
                    "CUDA_ERROR_INVALID_DEVICE",
                    "cuDeviceGet",
                    f"ordinal {ordinal}; this machine has {len(self._devices)}",
                )
            return self._devices[ordinal].handle

    def device_get_name(self, device: Device) -> str:
        with self._lock:
            self._ready("cuDeviceGetName")
            self._device(device, "cuDeviceGetName")
            return DEVICE_NAME

    def device_get_attribute(self, device: Device, attribute: str) -> int:
        with self._lock:
            self._ready("cuDeviceGetAttribute")
            self._device(device, "cuDeviceGetAttribute")
            value = DEVICE_ATTRIBUTES.get(attribute.upper().removeprefix("CU_DEVICE_ATTRIBUTE_"))
            if value is None:
                raise UsageError(
                    f"the simulated device does not model attribute {attribute!r}; "
                    f"it knows: {', '.join(DEVICE_ATTRIBUTES)}"
                )
            return value

    # -- contexts -----------------------------------------------------------------
    def primary_ctx_retain(self, device: Device) -> Context:
        with self._lock:
            self._ready("cuDevicePrimaryCtxRetain")
            state = self._device(device, "cuDevicePrimaryCtxRetain")
            capture.apply_hazards(
                self._captures(),
                "primary_ctx_retain",
                "cuDevicePrimaryCtxRetain",
                None,
                state.context_handle.value,
            )
            if state.context is None:
                state.context = _Context(state.context_handle, self._addresses, self._seq)
            state.refcount += 1
            return state.context_handle

    def primary_ctx_release(self, device: Device) -> None:
        with self._lock:
            self._ready("cuDevicePrimaryCtxRelease")
            state = self._device(device, "cuDevicePrimaryCtxRelease")
            if state.refcount == 0:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_CONTEXT",
                    "cuDevicePrimaryCtxRelease",
                    "the primary context is not retained",
                )
            capture.apply_hazards(
                self._captures(),
                "primary_ctx_release",
                "cuDevicePrimaryCtxRelease",
                None,
                state.context_handle.value,
            )
            state.refcount -= 1
            if state.refcount == 0 and state.context is not None:
                # Teardown synchronizes the device, then everything the context owned is gone,
                # even when a kernel stand-in fails during that synchronization.
                context, state.context = state.context, None
                context.streams.drain_all()

    def ctx_set_current(self, context: Context | None) -> None:
        with self._lock:
            self._ready("cuCtxSetCurrent")
            if context is not None and not any(
                d.context_handle.value == getattr(context, "value", None) for d in self._devices
            ):
                raise cuda_error("CUDA_ERROR_INVALID_CONTEXT", "cuCtxSetCurrent")
            self._tls.context = context

    def ctx_get_current(self) -> Context | None:
        # Per-thread state only, like the driver's: no lock (capsafe.device() asks on every bind).
        self._ready("cuCtxGetCurrent")
        current: Context | None = getattr(self._tls, "context", None)
        return current

    def ctx_synchronize(self) -> None:
        with self._lock:
            self._enter("ctx_synchronize", "cuCtxSynchronize").streams.drain_all()

    # -- streams and capture ----------------------------------------------------
    def stream_create(self, nonblocking: bool = True) -> Stream:
        with self._lock:
            ctx = self._enter("stream_create", "cuStreamCreate")
            kind = StreamKind.NONBLOCKING if nonblocking else StreamKind.BLOCKING
            handle = Stream(next(self._ids), kind=kind)
            ctx.streams.created[handle.value] = StreamState(handle)
            return handle

    def stream_destroy(self, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("stream_destroy", "cuStreamDestroy", stream)
            ss = self._stream(ctx, stream, "cuStreamDestroy")
            if ss is ctx.streams.legacy:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_HANDLE",
                    "cuStreamDestroy",
                    "the legacy stream cannot be destroyed",
                )
            drain(ss)  # the driver lets queued work finish
            del ctx.streams.created[stream.value]
            if ss.capture is not None:
                capture.discard(ctx.captures, ctx.memory, ss)

    def stream_synchronize(self, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("stream_synchronize", "cuStreamSynchronize", stream)
            ss = self._stream(ctx, stream, "cuStreamSynchronize")
            ss.check_not_invalidated("cuStreamSynchronize")
            ctx.streams.drain_with_implicit(ss)

    def stream_query(self, stream: Stream) -> bool:
        """Polling rule: with work pending, that work runs and the answer is False (NOT_READY)
        once; the next query answers True. A polling loop therefore always terminates."""
        with self._lock:
            ctx = self._enter("stream_query", "cuStreamQuery", stream)
            ss = self._stream(ctx, stream, "cuStreamQuery")
            ss.check_not_invalidated("cuStreamQuery")
            return not ctx.streams.drain_with_implicit(ss)

    def stream_is_capturing(self, stream: Stream) -> CaptureStatus:
        with self._lock:
            ctx = self._enter("stream_is_capturing", "cuStreamIsCapturing", stream)
            ss = self._stream(ctx, stream, "cuStreamIsCapturing")
            return CaptureStatus.NONE if ss.capture is None else ss.capture.status

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        with self._lock:
            ctx = self._enter("stream_wait_event", "cuStreamWaitEvent", stream)
            ss = self._stream(ctx, stream, "cuStreamWaitEvent")
            ev = self._lookup(ctx.events, event, Event, "cuStreamWaitEvent")
            deps = [] if ev.record is None or ev.done else [ev.record]
            ctx.streams.submit(ss, no_work, "cuStreamWaitEvent", deps)

    def stream_begin_capture(self, stream: Stream, mode: CaptureMode) -> None:
        with self._lock:
            ctx = self._enter("stream_begin_capture", "cuStreamBeginCapture", stream)
            ss = self._stream(ctx, stream, "cuStreamBeginCapture")
            capture.begin(ctx.captures, ss, mode, ctx.handle.value)

    def stream_end_capture(self, stream: Stream) -> Graph:
        with self._lock:
            ctx = self._enter("stream_end_capture", "cuStreamEndCapture", stream)
            ss = self._stream(ctx, stream, "cuStreamEndCapture")
            data = capture.end(ctx.captures, ctx.memory, ss)
            handle = Graph(next(self._ids))
            ctx.graphs[handle.value] = data
            return handle

    def graph_instantiate(self, graph: Graph) -> GraphExec:
        with self._lock:
            ctx = self._enter("graph_instantiate", "cuGraphInstantiate")
            data = self._lookup(ctx.graphs, graph, Graph, "cuGraphInstantiate")
            data.refs += 1
            handle = GraphExec(next(self._ids))
            ctx.execs[handle.value] = data
            return handle

    def graph_launch(self, graph_exec: GraphExec, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("graph_launch", "cuGraphLaunch", stream)
            data = self._lookup(ctx.execs, graph_exec, GraphExec, "cuGraphLaunch")
            ss = self._stream(ctx, stream, "cuGraphLaunch")
            ctx.streams.submit(ss, capture.replay(data.nodes), "cuGraphLaunch")

    def graph_exec_destroy(self, graph_exec: GraphExec) -> None:
        with self._lock:
            ctx = self._enter("graph_exec_destroy", "cuGraphExecDestroy")
            data = self._lookup(ctx.execs, graph_exec, GraphExec, "cuGraphExecDestroy")
            del ctx.execs[graph_exec.value]
            data.unref(ctx.memory)

    def graph_destroy(self, graph: Graph) -> None:
        with self._lock:
            ctx = self._enter("graph_destroy", "cuGraphDestroy")
            data = self._lookup(ctx.graphs, graph, Graph, "cuGraphDestroy")
            del ctx.graphs[graph.value]
            data.unref(ctx.memory)

    # -- events ---------------------------------------------------------------------
    def event_create(self, timing: bool = False) -> Event:
        with self._lock:
            ctx = self._enter("event_create", "cuEventCreate")
            handle = Event(next(self._ids))
            ctx.events[handle.value] = EventState()
            return handle

    def event_record(self, event: Event, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("event_record", "cuEventRecord", stream)
            ev = self._lookup(ctx.events, event, Event, "cuEventRecord")
            ss = self._stream(ctx, stream, "cuEventRecord")

            def record(s: StreamState, seq: int) -> Callable[[], None]:
                ev.record = (s, seq)
                return nothing

            ctx.streams.submit(ss, record, "cuEventRecord")

    def event_synchronize(self, event: Event) -> None:
        with self._lock:
            ctx = self._enter("event_synchronize", "cuEventSynchronize")
            ev = self._lookup(ctx.events, event, Event, "cuEventSynchronize")
            if ev.record is not None and not ev.done:
                drain(*ev.record)

    def event_query(self, event: Event) -> bool:
        """Same polling rule as stream_query: pending work runs, answering False once."""
        with self._lock:
            ctx = self._enter("event_query", "cuEventQuery")
            ev = self._lookup(ctx.events, event, Event, "cuEventQuery")
            if ev.record is None or ev.done:
                return True
            drain(*ev.record)
            return False

    def event_destroy(self, event: Event) -> None:
        with self._lock:
            ctx = self._enter("event_destroy", "cuEventDestroy")
            self._lookup(ctx.events, event, Event, "cuEventDestroy")
            del ctx.events[event.value]

    # -- memory -----------------------------------------------------------------------
    def mem_alloc(self, size: int) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_alloc", "cuMemAlloc")
            region = ctx.memory.new_alloc(size, "cuMemAlloc")
            return DevicePtr(region.base, size=size)

    def mem_free(self, ptr: DevicePtr) -> None:
        with self._lock:
            ctx = self._enter("mem_free", "cuMemFree")
            region = ctx.memory.alloc_at(ptr, "cuMemFree")
            ctx.streams.drain_all()  # cuMemFree waits for the device
            ctx.memory.drop_region(region)

    def mem_alloc_async(self, size: int, stream: Stream) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_alloc_async", "cuMemAllocAsync", stream)
            ss = self._stream(ctx, stream, "cuMemAllocAsync")
            ss.check_not_invalidated("cuMemAllocAsync")
            region = ctx.memory.new_alloc(size, "cuMemAllocAsync")
            if ss.capture is not None:
                region.graph_owned = True
                ss.capture.owned.append(region)
            ctx.streams.submit(ss, no_work, "cuMemAllocAsync")
            return DevicePtr(region.base, size=size)

    def mem_free_async(self, ptr: DevicePtr, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("mem_free_async", "cuMemFreeAsync", stream)
            ss = self._stream(ctx, stream, "cuMemFreeAsync")
            found = ctx.memory.regions.get(int(ptr))
            if isinstance(found, Alloc) and found.graph_owned and ss.capture is not None:
                ctx.streams.submit(ss, no_work, "cuMemFreeAsync")
                return
            region = ctx.memory.alloc_at(ptr, "cuMemFreeAsync")
            memory = ctx.memory

            def free(s: StreamState, seq: int) -> Callable[[], None]:
                return lambda: memory.drop_if_live(region)

            ctx.streams.submit(ss, free, "cuMemFreeAsync")
            if ss.capture is None:
                region.freeing = True

    def mem_host_alloc(self, size: int) -> HostPtr:
        with self._lock:
            ctx = self._enter("mem_host_alloc", "cuMemHostAlloc")
            return ctx.memory.new_host(size, "cuMemHostAlloc")

    def mem_free_host(self, ptr: HostPtr) -> None:
        with self._lock:
            ctx = self._enter("mem_free_host", "cuMemFreeHost")
            if not isinstance(ptr, HostPtr) or ptr.value not in ctx.memory.hosts:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE", "cuMemFreeHost", "not a live cuMemHostAlloc pointer"
                )
            del ctx.memory.hosts[ptr.value]

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            ctx = self._enter("mem_get_info", "cuMemGetInfo")
            return TOTAL_MEMORY - ctx.memory.used, TOTAL_MEMORY

    @staticmethod
    def _htod(ctx: _Context, dst: DevicePtr, src: Any, symbol: str) -> Node:
        memory = ctx.memory
        view = memory.host_view(src, writable=False, symbol=symbol)
        memory.device_span(dst, view.nbytes, symbol)

        def node(s: StreamState, seq: int) -> Callable[[], None]:
            spans = memory.device_span(dst, view.nbytes, symbol)
            return lambda: write_spans(spans, view)

        return node

    @staticmethod
    def _dtoh(ctx: _Context, dst: Any, src: DevicePtr, size: int | None, symbol: str) -> Node:
        memory = ctx.memory
        view = memory.host_view(dst, writable=True, symbol=symbol)
        n = view.nbytes if size is None else size
        if n > view.nbytes:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{n} bytes do not fit the {view.nbytes}-byte destination",
            )
        memory.device_span(src, n, symbol)

        def node(s: StreamState, seq: int) -> Callable[[], None]:
            spans = memory.device_span(src, n, symbol)
            return lambda: read_spans(spans, view)

        return node

    @staticmethod
    def _memset(ctx: _Context, ptr: DevicePtr, value: int, count: int, symbol: str) -> Node:
        if not 0 <= int(value) <= 255:
            raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, f"byte value {value!r}")
        memory = ctx.memory
        memory.device_span(ptr, count, symbol)

        def node(s: StreamState, seq: int) -> Callable[[], None]:
            spans = memory.device_span(ptr, count, symbol)

            def run() -> None:
                for backing, offset, length in spans:
                    backing.fill(offset, length, int(value))

            return run

        return node

    def memcpy_htod(self, dst: DevicePtr, src: Any) -> None:
        with self._lock:
            ctx = self._enter("memcpy_htod", "cuMemcpyHtoD")
            ctx.streams.run_sync(self._htod(ctx, dst, src, "cuMemcpyHtoD"), "cuMemcpyHtoD")

    def memcpy_dtoh(self, dst: Any, src: DevicePtr, size: int | None = None) -> None:
        with self._lock:
            ctx = self._enter("memcpy_dtoh", "cuMemcpyDtoH")
            node = self._dtoh(ctx, dst, src, size, "cuMemcpyDtoH")
            ctx.streams.run_sync(node, "cuMemcpyDtoH")

    def memcpy_htod_async(self, dst: DevicePtr, src: Any, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("memcpy_htod_async", "cuMemcpyHtoDAsync", stream)
            ss = self._stream(ctx, stream, "cuMemcpyHtoDAsync")
            node = self._htod(ctx, dst, src, "cuMemcpyHtoDAsync")
            ctx.streams.submit(ss, node, "cuMemcpyHtoDAsync")

    def memcpy_dtoh_async(
        self, dst: Any, src: DevicePtr, stream: Stream, size: int | None = None
    ) -> None:
        with self._lock:
            ctx = self._enter("memcpy_dtoh_async", "cuMemcpyDtoHAsync", stream)
            ss = self._stream(ctx, stream, "cuMemcpyDtoHAsync")
            node = self._dtoh(ctx, dst, src, size, "cuMemcpyDtoHAsync")
            ctx.streams.submit(ss, node, "cuMemcpyDtoHAsync")

    def memset_d8(self, ptr: DevicePtr, value: int, count: int) -> None:
        with self._lock:
            ctx = self._enter("memset_d8", "cuMemsetD8")
            ctx.streams.run_sync(self._memset(ctx, ptr, value, count, "cuMemsetD8"), "cuMemsetD8")

    def memset_d8_async(self, ptr: DevicePtr, value: int, count: int, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("memset_d8_async", "cuMemsetD8Async", stream)
            ss = self._stream(ctx, stream, "cuMemsetD8Async")
            node = self._memset(ctx, ptr, value, count, "cuMemsetD8Async")
            ctx.streams.submit(ss, node, "cuMemsetD8Async")

    # -- modules and kernels -------------------------------------------------------
    def module_load_data(self, image: bytes) -> Module:
        with self._lock:
            ctx = self._enter("module_load_data", "cuModuleLoadData")
            state = parse_image(bytes(image))
            handle = Module(next(self._ids))
            ctx.modules[handle.value] = state
            return handle

    def module_get_function(self, module: Module, name: str) -> Function:
        with self._lock:
            ctx = self._enter("module_get_function", "cuModuleGetFunction")
            state = self._lookup(ctx.modules, module, Module, "cuModuleGetFunction")
            if not state.has_kernel(name):
                raise cuda_error(
                    "CUDA_ERROR_NOT_FOUND",
                    "cuModuleGetFunction",
                    f"no kernel named {name!r} in the module",
                )
            handle = Function(next(self._ids), name=name, module=module)
            ctx.functions[handle.value] = (module.value, name)
            return handle

    def module_unload(self, module: Module) -> None:
        with self._lock:
            ctx = self._enter("module_unload", "cuModuleUnload")
            self._lookup(ctx.modules, module, Module, "cuModuleUnload")
            del ctx.modules[module.value]

    def launch_kernel(
        self,
        function: Function,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        stream: Stream,
        shared_mem: int = 0,
    ) -> None:
        symbol = "cuLaunchKernel"
        with self._lock:
            ctx = self._enter("launch_kernel", symbol, stream)
            module_id, name = self._lookup(ctx.functions, function, Function, symbol)
            if module_id not in ctx.modules:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_HANDLE", symbol, f"the module of {name!r} was unloaded"
                )
            ss = self._stream(ctx, stream, symbol)
            grid3, block3 = check_launch(grid, block, shared_mem, symbol)
            checked = check_kernel_args(args)
            memory = ctx.memory

            def node(s: StreamState, seq: int) -> Callable[[], None]:
                def run() -> None:
                    fn = standin(name)
                    if fn is None:
                        return
                    try:
                        fn(SimMemory(memory, name), grid3, block3, checked)
                    except CudaError:
                        raise
                    except Exception as exc:
                        raise cuda_error(
                            "CUDA_ERROR_LAUNCH_FAILED",
                            f"{symbol}({name})",
                            f"the stand-in raised {exc!r}",
                        ) from exc

                return run

            ctx.streams.submit(ss, node, symbol)

    # -- virtual memory management --------------------------------------------------
    def mem_get_allocation_granularity(self, device: Device) -> int:
        with self._lock:
            self._ready("cuMemGetAllocationGranularity")
            self._device(device, "cuMemGetAllocationGranularity")
            return ALLOCATION_GRANULARITY

    def mem_create(self, size: int, device: Device) -> MemHandle:
        with self._lock:
            ctx = self._enter("mem_create", "cuMemCreate")
            self._device(device, "cuMemCreate")
            physical = ctx.memory.new_physical(size, "cuMemCreate")
            handle = MemHandle(next(self._ids), size=size)
            ctx.memory.physical[handle.value] = physical
            return handle

    def mem_address_reserve(self, size: int, alignment: int = 0) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_address_reserve", "cuMemAddressReserve")
            region = ctx.memory.reserve_range(size, alignment, "cuMemAddressReserve")
            return DevicePtr(region.base, size=size)

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        with self._lock:
            ctx = self._enter("mem_map", "cuMemMap")
            region, offset = ctx.memory.reserved_range(ptr, size, "cuMemMap")
            physical = self._lookup(ctx.memory.physical, handle, MemHandle, "cuMemMap")
            if size > physical.size:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemMap",
                    f"{size} bytes exceed the {physical.size}-byte allocation",
                )
            if any(
                m.offset < offset + size and offset < m.offset + m.size for m in region.mappings
            ):
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE", "cuMemMap", "the range is already mapped"
                )
            region.mappings.append(Mapping(offset, size, physical))
            physical.mappings += 1

    def mem_set_access(self, ptr: DevicePtr, size: int, device: Device) -> None:
        with self._lock:
            ctx = self._enter("mem_set_access", "cuMemSetAccess")
            self._device(device, "cuMemSetAccess")
            region, offset = ctx.memory.reserved_range(ptr, size, "cuMemSetAccess")
            mappings = region.covering(offset, size)
            if mappings is None:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE", "cuMemSetAccess", "the range is not fully mapped"
                )
            for mapping in mappings:
                mapping.accessible = True

    def mem_unmap(self, ptr: DevicePtr, size: int) -> None:
        with self._lock:
            ctx = self._enter("mem_unmap", "cuMemUnmap")
            region, offset = ctx.memory.reserved_range(ptr, size, "cuMemUnmap")
            mappings = region.covering(offset, size)
            if mappings is None or any(
                m.offset < offset or m.offset + m.size > offset + size for m in mappings
            ):
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemUnmap",
                    "the range must cover whole mappings without gaps",
                )
            for mapping in mappings:
                region.mappings.remove(mapping)
                mapping.physical.mappings -= 1
                ctx.memory.maybe_free_physical(mapping.physical)

    def mem_release(self, handle: MemHandle) -> None:
        with self._lock:
            ctx = self._enter("mem_release", "cuMemRelease")
            physical = self._lookup(ctx.memory.physical, handle, MemHandle, "cuMemRelease")
            del ctx.memory.physical[handle.value]
            physical.released = True  # the memory lives on while it is still mapped
            ctx.memory.maybe_free_physical(physical)

    def mem_address_free(self, ptr: DevicePtr, size: int) -> None:
        with self._lock:
            ctx = self._enter("mem_address_free", "cuMemAddressFree")
            region = ctx.memory.regions.get(int(ptr))
            if not isinstance(region, Reservation) or region.size != size:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemAddressFree",
                    "not a reserved range with that base and size",
                )
            if region.mappings:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemAddressFree",
                    "the range still has mappings; unmap them first",
                )
            ctx.memory.drop_region(region)


@_state.on_fork
def _after_fork_in_child() -> None:
    # A thread that held a backend's lock at fork time does not exist in the child: fresh locks.
    for backend in list(_live):
        backend._lock = threading.RLock()
