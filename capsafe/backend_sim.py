"""An in-process model of one NVIDIA H200, behind the same facade as the real driver.

It exists so everything above the driver runs, and is tested, on machines
without a GPU. What it models and what it is calibrated against is written up
in docs/sim.md; in short:

- memory is real bytes, so fills, copies and kernel stand-ins return real data;
- stream work runs lazily, in order per stream, only when something waits on
  it, so a missing synchronization reads stale bytes every time instead of
  sometimes;
- every call is checked against the measured capture table (`capsafe.hazards`)
  for every open capture, so a call that breaks a capture on the H200 breaks it
  here, with the same CUresult.

All state sits behind one re-entrant lock; nothing in the sim ever blocks while
holding it, so many threads may call at once.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from capsafe import hazards
from capsafe.backend import (
    Backend,
    Dim3,
    KernelArg,
    check_kernel_args,
    host_view,
    is_binary_image,
)
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
    HostPtr,
    MemHandle,
    Module,
    Stream,
    StreamKind,
)
from capsafe.hazard_calls import hazard_call

MIB = 1 << 20

# -- calibration: what an H200 with driver 580 (CUDA 13.0) reports ----------
DEVICE_NAME = "NVIDIA H200 (simulated)"
DRIVER_VERSION = 13000
TOTAL_MEMORY = 150_109_880_320  # cuMemGetInfo total on the H200, driver 580.159.04 (2026-11-29)
ALLOCATION_GRANULARITY = 2 * MIB
#: Newest PTX ISA each driver version JIT-compiles (PTX ISA 9.0 shipped with CUDA 13.0).
MAX_PTX_ISA = (9, 0)
DEVICE_ATTRIBUTES: dict[str, int] = {
    "COMPUTE_CAPABILITY_MAJOR": 9,
    "COMPUTE_CAPABILITY_MINOR": 0,
    "MULTIPROCESSOR_COUNT": 132,
    "WARP_SIZE": 32,
    "MAX_THREADS_PER_BLOCK": 1024,
    "MAX_BLOCK_DIM_X": 1024,
    "MAX_BLOCK_DIM_Y": 1024,
    "MAX_BLOCK_DIM_Z": 64,
    "MAX_GRID_DIM_X": 2**31 - 1,
    "MAX_GRID_DIM_Y": 65535,
    "MAX_GRID_DIM_Z": 65535,
    "MAX_SHARED_MEMORY_PER_BLOCK": 48 * 1024,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 227 * 1024,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
    "MAX_REGISTERS_PER_BLOCK": 65536,
    "TOTAL_CONSTANT_MEMORY": 64 * 1024,
    "UNIFIED_ADDRESSING": 1,
    "CONCURRENT_KERNELS": 1,
    "MANAGED_MEMORY": 1,
    "MEMORY_POOLS_SUPPORTED": 1,
    "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1,
}

# -- the simulated address space ----------------------------------------------
DEVICE_BASE = 0x7F00_0000_0000
HOST_BASE = 0x7E00_0000_0000
ALIGNMENT = 256
_PAGE = MIB  # bytes are stored in pages of up to this size, created on first write
_HANDLE_BASE = 0x5500_0000_0000  # streams, events, modules, graphs: fake driver pointers

_PTX_VERSION = re.compile(rb"^\s*\.version\s+(\d+)\.(\d+)", re.MULTILINE)
_PTX_ENTRY = re.compile(
    rb"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$%][\w$]*)", re.MULTILINE
)

# ---------------------------------------------------------------------------
# Kernel stand-ins
# ---------------------------------------------------------------------------

KernelStandIn = Callable[["SimMemory", Dim3, Dim3, Sequence[KernelArg]], None]
_kernels: dict[str, KernelStandIn] = {}
_kernels_lock = threading.Lock()


def register_kernel(name: str, fn: KernelStandIn | None = None) -> Any:
    """Run `fn(memory, grid, block, args)` when a kernel called `name` executes.

    Usable as `register_kernel(name, fn)` or as the decorator `@register_kernel(name)`.
    Registration is process-wide; tests should prefer `kernel_standin`, which undoes it.
    """

    def add(fn: KernelStandIn) -> KernelStandIn:
        with _kernels_lock:
            _kernels[name] = fn
        return fn

    return add if fn is None else add(fn)


def unregister_kernel(name: str) -> None:
    """Forget the stand-in for `name`; launches of it become opaque again."""
    with _kernels_lock:
        _kernels.pop(name, None)


@contextmanager
def kernel_standin(name: str, fn: KernelStandIn) -> Iterator[KernelStandIn]:
    """Register `fn` for `name` for the duration of the block, then restore what was there."""
    with _kernels_lock:
        previous = _kernels.get(name)
        _kernels[name] = fn
    try:
        yield fn
    finally:
        with _kernels_lock:
            if previous is None:
                _kernels.pop(name, None)
            else:
                _kernels[name] = previous


def _standin(name: str) -> KernelStandIn | None:
    with _kernels_lock:
        return _kernels.get(name)


class SimMemory:
    """The device memory a kernel stand-in sees: read and write by device pointer."""

    def __init__(self, backend: SimBackend, context: _Context, kernel: str) -> None:
        self._backend, self._context, self._kernel = backend, context, kernel

    def read(self, ptr: DevicePtr | int, n: int) -> bytes:
        spans = self._backend._resolve(
            self._context, int(ptr), n, self._symbol, "CUDA_ERROR_ILLEGAL_ADDRESS"
        )
        return b"".join(backing.read(offset, length) for backing, offset, length in spans)

    def write(self, ptr: DevicePtr | int, data: Any) -> None:
        view = memoryview(data).cast("B")
        spans = self._backend._resolve(
            self._context, int(ptr), view.nbytes, self._symbol, "CUDA_ERROR_ILLEGAL_ADDRESS"
        )
        _write_spans(spans, view)

    @property
    def _symbol(self) -> str:
        return f"cuLaunchKernel({self._kernel})"


# ---------------------------------------------------------------------------
# Device state
# ---------------------------------------------------------------------------


class _Backing:
    """Bytes of one allocation, stored in pages created on first write (zero until then)."""

    __slots__ = ("page", "pages", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.page = max(1, min(_PAGE, size))
        self.pages: dict[int, bytearray] = {}

    def _spans(self, offset: int, n: int) -> Iterator[tuple[int, int, int, int]]:
        """(page index, start in page, length, position in the request) over [offset, offset+n)."""
        pos = 0
        while pos < n:
            index, start = divmod(offset + pos, self.page)
            length = min(self.page - start, n - pos)
            yield index, start, length, pos
            pos += length

    def read(self, offset: int, n: int) -> bytes:
        out = bytearray(n)
        for index, start, length, pos in self._spans(offset, n):
            page = self.pages.get(index)
            if page is not None:
                out[pos : pos + length] = page[start : start + length]
        return bytes(out)

    def _page(self, index: int) -> bytearray:
        page = self.pages.get(index)
        if page is None:
            page = self.pages[index] = bytearray(self.page)
        return page

    def write(self, offset: int, data: memoryview) -> None:
        for index, start, length, pos in self._spans(offset, data.nbytes):
            self._page(index)[start : start + length] = data[pos : pos + length]

    def fill(self, offset: int, n: int, value: int) -> None:
        for index, start, length, _ in self._spans(offset, n):
            if value == 0 and length == self.page:
                self.pages.pop(index, None)
            else:
                self._page(index)[start : start + length] = bytes((value,)) * length


Span = tuple[_Backing, int, int]  # (backing, offset in it, length)


def _write_spans(spans: list[Span], data: memoryview) -> None:
    pos = 0
    for backing, offset, length in spans:
        backing.write(offset, data[pos : pos + length])
        pos += length


@dataclass(eq=False)
class _Alloc:
    base: int
    size: int
    backing: _Backing
    graph_owned: bool = False  # allocated during a capture: the graph frees it
    freeing: bool = False  # a stream-ordered free is pending


@dataclass(eq=False)
class _Physical:
    """A cuMemCreate allocation."""

    size: int
    backing: _Backing
    released: bool = False
    mappings: int = 0


@dataclass(eq=False)
class _Mapping:
    offset: int
    size: int
    physical: _Physical
    accessible: bool = False


@dataclass(eq=False)
class _Reservation:
    base: int
    size: int
    mappings: list[_Mapping] = field(default_factory=list)

    def covering(self, offset: int, n: int) -> list[_Mapping] | None:
        """The mappings that cover [offset, offset+n) without a gap, in order, else None."""
        found, pos = [], offset
        for mapping in sorted(self.mappings, key=lambda m: m.offset):
            if mapping.offset + mapping.size <= pos or pos >= offset + n:
                continue
            if mapping.offset > pos:
                return None
            found.append(mapping)
            pos = mapping.offset + mapping.size
        return found if pos >= offset + n else None


@dataclass(eq=False)
class _Op:
    seq: int
    run: Callable[[], None]
    deps: list[tuple[_StreamState, int]]


#: A piece of stream work before it is placed: called with the stream and the
#: sequence number it gets, it returns the runner. Captured work stays a node.
Node = Callable[["_StreamState", int], Callable[[], None]]


def _nothing() -> None:
    return None


@dataclass(eq=False)
class _Capture:
    stream: Stream
    mode: CaptureMode
    owner: int  # thread ident
    nodes: list[Node] = field(default_factory=list)
    owned: list[_Alloc] = field(default_factory=list)
    status: CaptureStatus = CaptureStatus.ACTIVE


@dataclass(eq=False)
class _StreamState:
    handle: Stream
    queue: deque[_Op] = field(default_factory=deque)
    done_seq: int = 0
    capture: _Capture | None = None

    @property
    def kind(self) -> StreamKind:
        return self.handle.kind


@dataclass(eq=False)
class _EventState:
    record: tuple[_StreamState, int] | None = None

    @property
    def done(self) -> bool:
        return self.record is None or self.record[0].done_seq >= self.record[1]


@dataclass(eq=False)
class _GraphData:
    nodes: list[Node]
    owned: list[_Alloc]
    refs: int = 1


@dataclass(eq=False)
class _ModuleState:
    names: frozenset[str] | None  # PTX entries; None for binaries (searched by name)
    image: bytes


class _Context:
    """Everything a primary context owns; dropped whole when its refcount reaches zero."""

    def __init__(self, handle: Context) -> None:
        self.handle = handle
        self.legacy = _StreamState(Stream(0, kind=StreamKind.LEGACY))
        self.streams: dict[int, _StreamState] = {}
        self.captures: dict[int, _Capture] = {}  # open captures by stream, in begin order
        self.events: dict[int, _EventState] = {}
        self.regions: dict[int, _Alloc | _Reservation] = {}
        self.bases: list[int] = []
        self.physical: dict[int, _Physical] = {}
        self.hosts: dict[int, HostPtr] = {}
        self.modules: dict[int, _ModuleState] = {}
        self.functions: dict[int, tuple[int, str]] = {}
        self.graphs: dict[int, _GraphData] = {}
        self.execs: dict[int, _GraphData] = {}
        self.used = 0

    def all_streams(self) -> Iterator[_StreamState]:
        yield self.legacy
        yield from self.streams.values()

    def add_region(self, region: _Alloc | _Reservation) -> None:
        self.regions[region.base] = region
        bisect.insort(self.bases, region.base)

    def drop_region(self, region: _Alloc | _Reservation) -> None:
        del self.regions[region.base]
        self.bases.remove(region.base)
        if isinstance(region, _Alloc):
            self.used -= _align(region.size, ALIGNMENT)

    def region_at(self, address: int) -> _Alloc | _Reservation | None:
        index = bisect.bisect_right(self.bases, address) - 1
        if index < 0:
            return None
        region = self.regions[self.bases[index]]
        return region if address < region.base + region.size else None


@dataclass(eq=False)
class _DeviceState:
    handle: Device
    context_handle: Context
    refcount: int = 0
    context: _Context | None = None


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


# ---------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------

_live: weakref.WeakSet[SimBackend] = weakref.WeakSet()


class SimBackend(Backend):
    """The simulated H200. Each instance is a separate device and driver."""

    name = "sim"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._initialized = False
        self._ids = itertools.count(_HANDLE_BASE, 0x10)
        self._seq = itertools.count(1)
        self._next_device_address = DEVICE_BASE
        self._next_host_address = HOST_BASE
        self._devices = [_DeviceState(Device(0, ordinal=0), Context(next(self._ids)))]
        _live.add(self)

    # -- entry checks ---------------------------------------------------------
    def _ready(self, symbol: str) -> None:
        if not self._initialized:
            raise cuda_error("CUDA_ERROR_NOT_INITIALIZED", symbol, "call init() first")

    def _enter(self, method: str, symbol: str, stream: Stream | None = None) -> _Context:
        """Check init, the calling thread's context and the capture table; return the context."""
        self._ready(symbol)
        ctx = self._current(symbol)
        self._apply_hazards(method, symbol, stream)
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

    def _captures(self) -> Iterator[_Capture]:
        # Kept per context at capture begin and end, so a call never scans every stream.
        for device in self._devices:
            if device.context is not None:
                yield from device.context.captures.values()

    def _apply_hazards(self, method: str, symbol: str, stream: Stream | None) -> None:
        """Fail the call, and invalidate each capture it breaks, per the hazard table."""
        me = threading.get_ident()
        fired: tuple[str, hazards.Rule] | None = None
        for capture in self._captures():
            if capture.status is not CaptureStatus.ACTIVE:
                continue
            call = hazard_call(method, stream, capture.stream)
            if call is None:
                continue
            caller = hazards.SAME_THREAD if capture.owner == me else hazards.OTHER_THREAD
            rule = hazards.rule_for(call, capture.mode, capture.stream.kind, caller)
            if rule is not None:
                capture.status = CaptureStatus.INVALIDATED
                fired = fired or (call, rule)
        if fired is not None:
            call, rule = fired
            raise cuda_error(rule.result, symbol, f"{call} during a capture: {rule.why}")

    # -- lookups ----------------------------------------------------------------
    def _device(self, device: Device, symbol: str) -> _DeviceState:
        if not isinstance(device, Device):
            raise UsageError(f"{symbol}: expected a Device, got {type(device).__name__}")
        if not 0 <= device.ordinal < len(self._devices):
            raise cuda_error("CUDA_ERROR_INVALID_DEVICE", symbol, f"ordinal {device.ordinal}")
        return self._devices[device.ordinal]

    def _stream(self, ctx: _Context, stream: Stream, symbol: str) -> _StreamState:
        if not isinstance(stream, Stream):
            raise UsageError(f"{symbol}: expected a Stream, got {type(stream).__name__}")
        if stream.value == 0:
            return ctx.legacy
        ss = ctx.streams.get(stream.value)
        if ss is None:
            raise cuda_error("CUDA_ERROR_INVALID_HANDLE", symbol, f"stream {stream.value:#x}")
        return ss

    def _lookup(self, table: dict[int, Any], handle: Any, kind: type, symbol: str) -> Any:
        if not isinstance(handle, kind):
            raise UsageError(f"{symbol}: expected a {kind.__name__}, got {type(handle).__name__}")
        found = table.get(handle.value)
        if found is None:
            raise cuda_error(
                "CUDA_ERROR_INVALID_HANDLE", symbol, f"{kind.__name__.lower()} {handle.value:#x}"
            )
        return found

    def _resolve(
        self,
        ctx: _Context,
        address: int,
        n: int,
        symbol: str,
        result: str = "CUDA_ERROR_INVALID_VALUE",
    ) -> list[Span]:
        """The bytes behind [address, address+n): one span per allocation or mapping touched."""
        if n < 0:
            raise cuda_error(result, symbol, f"negative size {n}")
        region = ctx.region_at(address)
        if region is None or address + n > region.base + region.size:
            raise cuda_error(
                result, symbol, f"{n} bytes at {address:#x} are not inside one allocation"
            )
        offset = address - region.base
        if isinstance(region, _Alloc):
            return [(region.backing, offset, n)] if n else []
        mappings = region.covering(offset, n)
        if mappings is None or not all(m.accessible for m in mappings):
            raise cuda_error(result, symbol, f"{address:#x}+{n} is not mapped and accessible")
        spans, pos, end = [], offset, offset + n
        for m in mappings:
            length = min(m.offset + m.size, end) - pos
            spans.append((m.physical.backing, pos - m.offset, length))
            pos += length
        return spans

    # -- stream machinery -----------------------------------------------------
    def _drain(self, ss: _StreamState, upto: int | None = None) -> None:
        """Run `ss`'s pending work in order, up to sequence number `upto` (all by default).

        An operation first waits for its dependencies (other streams up to a
        sequence number). Dependencies always point at work enqueued earlier, so
        this ends; it keeps an explicit stack so long event chains cannot
        exhaust Python's recursion limit.
        """
        stack: list[tuple[_StreamState, int | None]] = [(ss, upto)]
        while stack:
            stream, limit = stack[-1]
            if not stream.queue or (limit is not None and stream.queue[0].seq > limit):
                stack.pop()
                continue
            op = stream.queue[0]
            waiting = [(dep, seq) for dep, seq in op.deps if dep.queue and dep.queue[0].seq <= seq]
            if waiting:
                stack.extend(waiting)
                continue
            stream.queue.popleft()
            stream.done_seq = op.seq
            op.run()

    def _drain_with_implicit(self, ctx: _Context, ss: _StreamState) -> bool:
        """Run all of `ss`, and for the legacy stream the blocking work it waits for.

        Returns whether anything was pending.
        """
        deps = self._implicit_deps(ctx, ss) if ss.kind is StreamKind.LEGACY else []
        pending = bool(ss.queue or deps)
        for dep_stream, dep_seq in deps:
            self._drain(dep_stream, dep_seq)
        self._drain(ss)
        return pending

    def _implicit_deps(self, ctx: _Context, ss: _StreamState) -> list[tuple[_StreamState, int]]:
        """The legacy stream waits for blocking streams, and blocking streams for it."""
        if ss.kind is StreamKind.LEGACY:
            return [
                (b, b.queue[-1].seq)
                for b in ctx.streams.values()
                if b.kind is StreamKind.BLOCKING and b.queue
            ]
        if ss.kind is StreamKind.BLOCKING and ctx.legacy.queue:
            return [(ctx.legacy, ctx.legacy.queue[-1].seq)]
        return []

    def _submit(
        self,
        ctx: _Context,
        ss: _StreamState,
        node: Node,
        symbol: str,
        deps: Sequence[tuple[_StreamState, int]] = (),
    ) -> int | None:
        """Capture `node` if `ss` is capturing, else enqueue it; return its sequence number."""
        if ss.capture is not None:
            self._check_not_invalidated(ss, symbol)
            ss.capture.nodes.append(node)
            return None
        seq = next(self._seq)
        ss.queue.append(_Op(seq, node(ss, seq), [*self._implicit_deps(ctx, ss), *deps]))
        return seq

    def _run_sync(self, ctx: _Context, node: Node, symbol: str) -> None:
        """A synchronous call: legacy-stream work that completes before returning."""
        seq = self._submit(ctx, ctx.legacy, node, symbol)
        self._drain(ctx.legacy, seq)

    def _check_not_invalidated(self, ss: _StreamState, symbol: str) -> None:
        if ss.capture is not None and ss.capture.status is CaptureStatus.INVALIDATED:
            raise cuda_error(hazards.INVALIDATED, symbol, "the capture on this stream broke")

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
            self._apply_hazards("primary_ctx_retain", "cuDevicePrimaryCtxRetain", None)
            if state.context is None:
                state.context = _Context(state.context_handle)
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
            self._apply_hazards("primary_ctx_release", "cuDevicePrimaryCtxRelease", None)
            state.refcount -= 1
            if state.refcount == 0 and state.context is not None:
                # Teardown synchronizes the device, then everything the context owned is gone,
                # even when a kernel stand-in fails during that synchronization.
                context, state.context = state.context, None
                for ss in list(context.all_streams()):
                    self._drain(ss)

    def ctx_set_current(self, context: Context | None) -> None:
        with self._lock:
            self._ready("cuCtxSetCurrent")
            if context is not None and not any(
                d.context_handle.value == getattr(context, "value", None) for d in self._devices
            ):
                raise cuda_error("CUDA_ERROR_INVALID_CONTEXT", "cuCtxSetCurrent")
            self._tls.context = context

    def ctx_get_current(self) -> Context | None:
        with self._lock:
            self._ready("cuCtxGetCurrent")
            return getattr(self._tls, "context", None)

    def ctx_synchronize(self) -> None:
        with self._lock:
            ctx = self._enter("ctx_synchronize", "cuCtxSynchronize")
            for ss in list(ctx.all_streams()):
                self._drain(ss)

    # -- streams and capture ----------------------------------------------------
    def stream_create(self, nonblocking: bool = True) -> Stream:
        with self._lock:
            ctx = self._enter("stream_create", "cuStreamCreate")
            kind = StreamKind.NONBLOCKING if nonblocking else StreamKind.BLOCKING
            handle = Stream(next(self._ids), kind=kind)
            ctx.streams[handle.value] = _StreamState(handle)
            return handle

    def stream_destroy(self, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("stream_destroy", "cuStreamDestroy", stream)
            ss = self._stream(ctx, stream, "cuStreamDestroy")
            if ss is ctx.legacy:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_HANDLE",
                    "cuStreamDestroy",
                    "the legacy stream cannot be destroyed",
                )
            self._drain(ss)  # the driver lets queued work finish
            del ctx.streams[stream.value]
            if ss.capture is not None:
                self._discard_capture(ctx, ss)

    def stream_synchronize(self, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("stream_synchronize", "cuStreamSynchronize", stream)
            ss = self._stream(ctx, stream, "cuStreamSynchronize")
            self._check_not_invalidated(ss, "cuStreamSynchronize")
            self._drain_with_implicit(ctx, ss)

    def stream_query(self, stream: Stream) -> bool:
        """Polling rule: with work pending, that work runs and the answer is False (NOT_READY)
        once; the next query answers True. A polling loop therefore always terminates."""
        with self._lock:
            ctx = self._enter("stream_query", "cuStreamQuery", stream)
            ss = self._stream(ctx, stream, "cuStreamQuery")
            self._check_not_invalidated(ss, "cuStreamQuery")
            return not self._drain_with_implicit(ctx, ss)

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
            deps = [] if ev.done else [ev.record]
            self._submit(ctx, ss, lambda s, q: _nothing, "cuStreamWaitEvent", deps)

    def stream_begin_capture(self, stream: Stream, mode: CaptureMode) -> None:
        with self._lock:
            ctx = self._enter("stream_begin_capture", "cuStreamBeginCapture", stream)
            ss = self._stream(ctx, stream, "cuStreamBeginCapture")
            if ss.kind is StreamKind.LEGACY:
                raise cuda_error(
                    hazards.UNSUPPORTED,
                    "cuStreamBeginCapture",
                    "the legacy stream cannot be captured",
                )
            if ss.capture is not None:
                raise cuda_error(
                    "CUDA_ERROR_ILLEGAL_STATE",
                    "cuStreamBeginCapture",
                    "the stream is already capturing",
                )
            ss.capture = ctx.captures[ss.handle.value] = _Capture(
                stream=ss.handle, mode=CaptureMode.parse(mode), owner=threading.get_ident()
            )

    def stream_end_capture(self, stream: Stream) -> Graph:
        with self._lock:
            ctx = self._enter("stream_end_capture", "cuStreamEndCapture", stream)
            ss = self._stream(ctx, stream, "cuStreamEndCapture")
            capture = ss.capture
            if capture is None:
                raise cuda_error(
                    "CUDA_ERROR_ILLEGAL_STATE", "cuStreamEndCapture", "the stream is not capturing"
                )
            if capture.mode is not CaptureMode.RELAXED and capture.owner != threading.get_ident():
                raise cuda_error(
                    "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
                    "cuStreamEndCapture",
                    f"a {capture.mode.value} capture must end on its own thread",
                )
            if capture.status is CaptureStatus.INVALIDATED:
                self._discard_capture(ctx, ss)
                raise cuda_error(
                    hazards.INVALIDATED,
                    "cuStreamEndCapture",
                    "a call made during the capture broke it",
                )
            ss.capture = None
            del ctx.captures[ss.handle.value]
            handle = Graph(next(self._ids))
            ctx.graphs[handle.value] = _GraphData(list(capture.nodes), list(capture.owned))
            return handle

    def _discard_capture(self, ctx: _Context, ss: _StreamState) -> None:
        capture, ss.capture = ss.capture, None
        ctx.captures.pop(ss.handle.value, None)
        if capture is not None:
            self._free_owned(ctx, capture.owned)

    def _free_owned(self, ctx: _Context, owned: list[_Alloc]) -> None:
        for region in owned:
            if ctx.regions.get(region.base) is region:
                ctx.drop_region(region)

    def _unref_graph(self, ctx: _Context, data: _GraphData) -> None:
        data.refs -= 1
        if data.refs == 0:
            self._free_owned(ctx, data.owned)

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
            nodes = list(data.nodes)

            def replay(s: _StreamState, seq: int) -> Callable[[], None]:
                runners = [node(s, seq) for node in nodes]  # resolves addresses now

                def run() -> None:
                    for runner in runners:
                        runner()

                return run

            self._submit(ctx, ss, replay, "cuGraphLaunch")

    def graph_exec_destroy(self, graph_exec: GraphExec) -> None:
        with self._lock:
            ctx = self._enter("graph_exec_destroy", "cuGraphExecDestroy")
            data = self._lookup(ctx.execs, graph_exec, GraphExec, "cuGraphExecDestroy")
            del ctx.execs[graph_exec.value]
            self._unref_graph(ctx, data)

    def graph_destroy(self, graph: Graph) -> None:
        with self._lock:
            ctx = self._enter("graph_destroy", "cuGraphDestroy")
            data = self._lookup(ctx.graphs, graph, Graph, "cuGraphDestroy")
            del ctx.graphs[graph.value]
            self._unref_graph(ctx, data)

    # -- events ---------------------------------------------------------------------
    def event_create(self, timing: bool = False) -> Event:
        with self._lock:
            ctx = self._enter("event_create", "cuEventCreate")
            handle = Event(next(self._ids))
            ctx.events[handle.value] = _EventState()
            return handle

    def event_record(self, event: Event, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("event_record", "cuEventRecord", stream)
            ev = self._lookup(ctx.events, event, Event, "cuEventRecord")
            ss = self._stream(ctx, stream, "cuEventRecord")

            def record(s: _StreamState, seq: int) -> Callable[[], None]:
                ev.record = (s, seq)
                return _nothing

            self._submit(ctx, ss, record, "cuEventRecord")

    def event_synchronize(self, event: Event) -> None:
        with self._lock:
            ctx = self._enter("event_synchronize", "cuEventSynchronize")
            ev = self._lookup(ctx.events, event, Event, "cuEventSynchronize")
            if not ev.done:
                self._drain(*ev.record)

    def event_query(self, event: Event) -> bool:
        """Same polling rule as stream_query: pending work runs, answering False once."""
        with self._lock:
            ctx = self._enter("event_query", "cuEventQuery")
            ev = self._lookup(ctx.events, event, Event, "cuEventQuery")
            if ev.done:
                return True
            self._drain(*ev.record)
            return False

    def event_destroy(self, event: Event) -> None:
        with self._lock:
            ctx = self._enter("event_destroy", "cuEventDestroy")
            self._lookup(ctx.events, event, Event, "cuEventDestroy")
            del ctx.events[event.value]

    # -- memory -----------------------------------------------------------------------
    def _new_alloc(self, ctx: _Context, size: int, symbol: str) -> _Alloc:
        if not isinstance(size, int) or size <= 0:
            raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, f"size {size!r}")
        self._reserve_bytes(ctx, _align(size, ALIGNMENT), symbol)
        base = self._next_device_address
        self._next_device_address = _align(base + size, ALIGNMENT)
        region = _Alloc(base, size, _Backing(size))
        ctx.add_region(region)
        return region

    def _reserve_bytes(self, ctx: _Context, size: int, symbol: str) -> None:
        if ctx.used + size > TOTAL_MEMORY:
            free_mib = (TOTAL_MEMORY - ctx.used) // MIB
            raise cuda_error(
                "CUDA_ERROR_OUT_OF_MEMORY",
                symbol,
                f"asked for {size} bytes with {free_mib} MiB free",
            )
        ctx.used += size

    def _alloc_at(self, ctx: _Context, ptr: DevicePtr, symbol: str) -> _Alloc:
        region = ctx.regions.get(int(ptr))
        if not isinstance(region, _Alloc) or region.freeing or region.graph_owned:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{int(ptr):#x} is not the start of a live allocation",
            )
        return region

    def mem_alloc(self, size: int) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_alloc", "cuMemAlloc")
            region = self._new_alloc(ctx, size, "cuMemAlloc")
            return DevicePtr(region.base, size=size)

    def mem_free(self, ptr: DevicePtr) -> None:
        with self._lock:
            ctx = self._enter("mem_free", "cuMemFree")
            region = self._alloc_at(ctx, ptr, "cuMemFree")
            for ss in list(ctx.all_streams()):  # cuMemFree waits for the device
                self._drain(ss)
            ctx.drop_region(region)

    def mem_alloc_async(self, size: int, stream: Stream) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_alloc_async", "cuMemAllocAsync", stream)
            ss = self._stream(ctx, stream, "cuMemAllocAsync")
            self._check_not_invalidated(ss, "cuMemAllocAsync")
            region = self._new_alloc(ctx, size, "cuMemAllocAsync")
            if ss.capture is not None:
                region.graph_owned = True
                ss.capture.owned.append(region)
            self._submit(ctx, ss, lambda s, q: _nothing, "cuMemAllocAsync")
            return DevicePtr(region.base, size=size)

    def mem_free_async(self, ptr: DevicePtr, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("mem_free_async", "cuMemFreeAsync", stream)
            ss = self._stream(ctx, stream, "cuMemFreeAsync")
            region = ctx.regions.get(int(ptr))
            if isinstance(region, _Alloc) and region.graph_owned and ss.capture is not None:
                self._submit(ctx, ss, lambda s, q: _nothing, "cuMemFreeAsync")
                return
            region = self._alloc_at(ctx, ptr, "cuMemFreeAsync")

            def free(s: _StreamState, seq: int) -> Callable[[], None]:
                def run() -> None:
                    if ctx.regions.get(region.base) is region:
                        ctx.drop_region(region)

                return run

            self._submit(ctx, ss, free, "cuMemFreeAsync")
            if ss.capture is None:
                region.freeing = True

    def mem_host_alloc(self, size: int) -> HostPtr:
        with self._lock:
            ctx = self._enter("mem_host_alloc", "cuMemHostAlloc")
            if not isinstance(size, int) or size <= 0:
                raise cuda_error("CUDA_ERROR_INVALID_VALUE", "cuMemHostAlloc", f"size {size!r}")
            base = self._next_host_address
            self._next_host_address = _align(base + size, 4096)
            handle = HostPtr(base, size=size, buffer=memoryview(bytearray(size)))
            ctx.hosts[base] = handle
            return handle

    def mem_free_host(self, ptr: HostPtr) -> None:
        with self._lock:
            ctx = self._enter("mem_free_host", "cuMemFreeHost")
            if not isinstance(ptr, HostPtr) or ptr.value not in ctx.hosts:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE", "cuMemFreeHost", "not a live cuMemHostAlloc pointer"
                )
            del ctx.hosts[ptr.value]

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            ctx = self._enter("mem_get_info", "cuMemGetInfo")
            return TOTAL_MEMORY - ctx.used, TOTAL_MEMORY

    def _host_view(self, ctx: _Context, buffer: Any, *, writable: bool, symbol: str) -> memoryview:
        if isinstance(buffer, HostPtr):
            if ctx.hosts.get(buffer.value) is None:
                raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, "host memory was freed")
            buffer = buffer.buffer
        return host_view(buffer, writable=writable)

    def _device_span(self, ctx: _Context, ptr: DevicePtr, n: int, symbol: str) -> list[Span]:
        if not isinstance(ptr, DevicePtr):
            raise UsageError(f"{symbol}: expected a DevicePtr, got {type(ptr).__name__}")
        return self._resolve(ctx, ptr.value, n, symbol)

    def _htod(self, ctx: _Context, dst: DevicePtr, src: Any, symbol: str) -> Node:
        view = self._host_view(ctx, src, writable=False, symbol=symbol)
        self._device_span(ctx, dst, view.nbytes, symbol)

        def node(s: _StreamState, seq: int) -> Callable[[], None]:
            spans = self._device_span(ctx, dst, view.nbytes, symbol)
            return lambda: _write_spans(spans, view)

        return node

    def _dtoh(self, ctx: _Context, dst: Any, src: DevicePtr, size: int | None, symbol: str) -> Node:
        view = self._host_view(ctx, dst, writable=True, symbol=symbol)
        n = view.nbytes if size is None else size
        if n > view.nbytes:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{n} bytes do not fit the {view.nbytes}-byte destination",
            )
        self._device_span(ctx, src, n, symbol)

        def node(s: _StreamState, seq: int) -> Callable[[], None]:
            spans = self._device_span(ctx, src, n, symbol)

            def run() -> None:
                pos = 0
                for backing, offset, length in spans:
                    view[pos : pos + length] = backing.read(offset, length)
                    pos += length

            return run

        return node

    def _memset(self, ctx: _Context, ptr: DevicePtr, value: int, count: int, symbol: str) -> Node:
        if not 0 <= int(value) <= 255:
            raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, f"byte value {value!r}")
        self._device_span(ctx, ptr, count, symbol)

        def node(s: _StreamState, seq: int) -> Callable[[], None]:
            spans = self._device_span(ctx, ptr, count, symbol)

            def run() -> None:
                for backing, offset, length in spans:
                    backing.fill(offset, length, int(value))

            return run

        return node

    def memcpy_htod(self, dst: DevicePtr, src: Any) -> None:
        with self._lock:
            ctx = self._enter("memcpy_htod", "cuMemcpyHtoD")
            self._run_sync(ctx, self._htod(ctx, dst, src, "cuMemcpyHtoD"), "cuMemcpyHtoD")

    def memcpy_dtoh(self, dst: Any, src: DevicePtr, size: int | None = None) -> None:
        with self._lock:
            ctx = self._enter("memcpy_dtoh", "cuMemcpyDtoH")
            self._run_sync(ctx, self._dtoh(ctx, dst, src, size, "cuMemcpyDtoH"), "cuMemcpyDtoH")

    def memcpy_htod_async(self, dst: DevicePtr, src: Any, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("memcpy_htod_async", "cuMemcpyHtoDAsync", stream)
            ss = self._stream(ctx, stream, "cuMemcpyHtoDAsync")
            node = self._htod(ctx, dst, src, "cuMemcpyHtoDAsync")
            self._submit(ctx, ss, node, "cuMemcpyHtoDAsync")

    def memcpy_dtoh_async(
        self, dst: Any, src: DevicePtr, stream: Stream, size: int | None = None
    ) -> None:
        with self._lock:
            ctx = self._enter("memcpy_dtoh_async", "cuMemcpyDtoHAsync", stream)
            ss = self._stream(ctx, stream, "cuMemcpyDtoHAsync")
            node = self._dtoh(ctx, dst, src, size, "cuMemcpyDtoHAsync")
            self._submit(ctx, ss, node, "cuMemcpyDtoHAsync")

    def memset_d8(self, ptr: DevicePtr, value: int, count: int) -> None:
        with self._lock:
            ctx = self._enter("memset_d8", "cuMemsetD8")
            self._run_sync(ctx, self._memset(ctx, ptr, value, count, "cuMemsetD8"), "cuMemsetD8")

    def memset_d8_async(self, ptr: DevicePtr, value: int, count: int, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("memset_d8_async", "cuMemsetD8Async", stream)
            ss = self._stream(ctx, stream, "cuMemsetD8Async")
            node = self._memset(ctx, ptr, value, count, "cuMemsetD8Async")
            self._submit(ctx, ss, node, "cuMemsetD8Async")

    # -- modules and kernels -------------------------------------------------------
    def module_load_data(self, image: bytes) -> Module:
        with self._lock:
            ctx = self._enter("module_load_data", "cuModuleLoadData")
            state = _parse_image(bytes(image))
            handle = Module(next(self._ids))
            ctx.modules[handle.value] = state
            return handle

    def module_get_function(self, module: Module, name: str) -> Function:
        with self._lock:
            ctx = self._enter("module_get_function", "cuModuleGetFunction")
            state = self._lookup(ctx.modules, module, Module, "cuModuleGetFunction")
            found = (
                name in state.names
                if state.names is not None
                else b"\x00" + name.encode() + b"\x00" in state.image
            )
            if not found:
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
            grid, block = _check_launch(grid, block, shared_mem, symbol)
            args = check_kernel_args(args)

            def node(s: _StreamState, seq: int) -> Callable[[], None]:
                def run() -> None:
                    fn = _standin(name)
                    if fn is None:
                        return
                    try:
                        fn(SimMemory(self, ctx, name), grid, block, args)
                    except CudaError:
                        raise
                    except Exception as exc:
                        raise cuda_error(
                            "CUDA_ERROR_LAUNCH_FAILED",
                            f"{symbol}({name})",
                            f"the stand-in raised {exc!r}",
                        ) from exc

                return run

            self._submit(ctx, ss, node, symbol)

    # -- virtual memory management --------------------------------------------------
    def mem_get_allocation_granularity(self, device: Device) -> int:
        with self._lock:
            self._ready("cuMemGetAllocationGranularity")
            self._device(device, "cuMemGetAllocationGranularity")
            return ALLOCATION_GRANULARITY

    def _check_granular(self, value: int, what: str, symbol: str) -> None:
        if value <= 0 or value % ALLOCATION_GRANULARITY:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{what} {value} is not a positive multiple of "
                f"the {ALLOCATION_GRANULARITY}-byte granularity",
            )

    def mem_create(self, size: int, device: Device) -> MemHandle:
        with self._lock:
            ctx = self._enter("mem_create", "cuMemCreate")
            self._device(device, "cuMemCreate")
            self._check_granular(size, "size", "cuMemCreate")
            self._reserve_bytes(ctx, size, "cuMemCreate")
            handle = MemHandle(next(self._ids), size=size)
            ctx.physical[handle.value] = _Physical(size, _Backing(size))
            return handle

    def mem_address_reserve(self, size: int, alignment: int = 0) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_address_reserve", "cuMemAddressReserve")
            self._check_granular(size, "size", "cuMemAddressReserve")
            if alignment < 0 or alignment & (alignment - 1):
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemAddressReserve",
                    f"alignment {alignment} is not a power of two",
                )
            base = _align(self._next_device_address, max(alignment, ALLOCATION_GRANULARITY))
            self._next_device_address = base + size
            ctx.add_region(_Reservation(base, size))
            return DevicePtr(base, size=size)

    def _reserved_range(
        self, ctx: _Context, ptr: DevicePtr, size: int, symbol: str
    ) -> tuple[_Reservation, int]:
        region = ctx.region_at(int(ptr))
        if not isinstance(region, _Reservation) or int(ptr) + size > region.base + region.size:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{int(ptr):#x}+{size} is not inside a reserved address range",
            )
        offset = int(ptr) - region.base
        self._check_granular(size, "size", symbol)
        if offset % ALLOCATION_GRANULARITY:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE", symbol, f"{int(ptr):#x} is not granularity-aligned"
            )
        return region, offset

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        with self._lock:
            ctx = self._enter("mem_map", "cuMemMap")
            region, offset = self._reserved_range(ctx, ptr, size, "cuMemMap")
            physical = self._lookup(ctx.physical, handle, MemHandle, "cuMemMap")
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
            region.mappings.append(_Mapping(offset, size, physical))
            physical.mappings += 1

    def mem_set_access(self, ptr: DevicePtr, size: int, device: Device) -> None:
        with self._lock:
            ctx = self._enter("mem_set_access", "cuMemSetAccess")
            self._device(device, "cuMemSetAccess")
            region, offset = self._reserved_range(ctx, ptr, size, "cuMemSetAccess")
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
            region, offset = self._reserved_range(ctx, ptr, size, "cuMemUnmap")
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
                self._maybe_free_physical(ctx, mapping.physical)

    def _maybe_free_physical(self, ctx: _Context, physical: _Physical) -> None:
        if physical.released and physical.mappings == 0:
            ctx.used -= physical.size

    def mem_release(self, handle: MemHandle) -> None:
        with self._lock:
            ctx = self._enter("mem_release", "cuMemRelease")
            physical = self._lookup(ctx.physical, handle, MemHandle, "cuMemRelease")
            del ctx.physical[handle.value]
            physical.released = True  # the memory lives on while it is still mapped
            self._maybe_free_physical(ctx, physical)

    def mem_address_free(self, ptr: DevicePtr, size: int) -> None:
        with self._lock:
            ctx = self._enter("mem_address_free", "cuMemAddressFree")
            region = ctx.regions.get(int(ptr))
            if not isinstance(region, _Reservation) or region.size != size:
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
            ctx.drop_region(region)


def _check_launch(grid: Dim3, block: Dim3, shared_mem: int, symbol: str) -> tuple[Dim3, Dim3]:
    grid, block = tuple(int(v) for v in grid), tuple(int(v) for v in block)
    limits = DEVICE_ATTRIBUTES
    grid_max = (limits["MAX_GRID_DIM_X"], limits["MAX_GRID_DIM_Y"], limits["MAX_GRID_DIM_Z"])
    block_max = (limits["MAX_BLOCK_DIM_X"], limits["MAX_BLOCK_DIM_Y"], limits["MAX_BLOCK_DIM_Z"])
    if (
        len(grid) != 3
        or len(block) != 3
        or not all(1 <= v <= m for v, m in zip(grid, grid_max, strict=True))
        or not all(1 <= v <= m for v, m in zip(block, block_max, strict=True))
        or block[0] * block[1] * block[2] > limits["MAX_THREADS_PER_BLOCK"]
    ):
        raise cuda_error(
            "CUDA_ERROR_INVALID_VALUE",
            symbol,
            f"grid {grid} / block {block} outside the device limits",
        )
    if not 0 <= shared_mem <= limits["MAX_SHARED_MEMORY_PER_BLOCK"]:
        raise cuda_error(
            "CUDA_ERROR_INVALID_VALUE",
            symbol,
            f"{shared_mem} bytes of dynamic shared memory exceed the 48 KiB default",
        )
    return grid, block  # type: ignore[return-value]


def _parse_image(image: bytes) -> _ModuleState:
    """Accept what cuModuleLoadData accepts: PTX text, a CUBIN (ELF) or a fatbin."""
    if is_binary_image(image):
        return _ModuleState(None, image)
    text = image.rstrip(b"\x00")
    if not text:
        raise cuda_error("CUDA_ERROR_INVALID_VALUE", "cuModuleLoadData", "empty image")
    if b"\x00" in text or not text.isascii():
        raise cuda_error(
            "CUDA_ERROR_INVALID_IMAGE",
            "cuModuleLoadData",
            "neither PTX text nor an ELF/fatbin image",
        )
    version = _PTX_VERSION.search(text)
    if version is None:
        raise cuda_error("CUDA_ERROR_INVALID_PTX", "cuModuleLoadData", "no .version directive")
    isa = (int(version[1]), int(version[2]))
    if isa > MAX_PTX_ISA:
        raise cuda_error(
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
            "cuModuleLoadData",
            f"PTX ISA {isa[0]}.{isa[1]} is newer than driver {DRIVER_VERSION} "
            f"supports ({MAX_PTX_ISA[0]}.{MAX_PTX_ISA[1]})",
        )
    names = frozenset(m.decode() for m in _PTX_ENTRY.findall(text))
    return _ModuleState(names, image)


def _after_fork_in_child() -> None:
    # A thread that held a lock at fork time does not exist in the child: fresh locks.
    global _kernels_lock
    _kernels_lock = threading.Lock()
    for backend in list(_live):
        backend._lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
