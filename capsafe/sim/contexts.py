"""The simulated driver's devices and primary contexts, and the checks every call makes first.

`SimDriverBase` holds the state of one simulated driver and the calls on devices and
contexts; the other driver calls are grouped by what they work on
(`stream_calls`: streams, events, captures and graphs; `memory_calls`: memory, copies
and VMM; `kernel_calls`: modules and launches) and `backend.SimBackend` joins them.
Every call enters through `_enter`: initialized, a current context on this thread, and
the hazard table applied to the open captures (`capture.apply_hazards`), in the
driver's order.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

from capsafe.backend import Backend
from capsafe.errors import UsageError, cuda_error
from capsafe.handles import Context, Device, Handle, Stream
from capsafe.sim import capture
from capsafe.sim.calibration import DEVICE_ATTRIBUTES, DEVICE_NAME, DRIVER_VERSION
from capsafe.sim.capture import Capture, Captures, GraphData
from capsafe.sim.kernels import ModuleState
from capsafe.sim.memory import AddressSpace, ContextMemory
from capsafe.sim.streams import ContextStreams, EventState, StreamState

HANDLE_BASE = 0x5500_0000_0000  # streams, events, modules, graphs: fake driver pointers

T = TypeVar("T")


class ContextState:
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
class DeviceState:
    handle: Device
    context_handle: Context
    refcount: int = 0
    context: ContextState | None = None


class SimDriverBase(Backend):
    """One simulated driver's state (made by `SimBackend.__init__`), its entry checks and
    handle lookups, and the device and context calls.

    All state sits behind one re-entrant lock; nothing in the sim ever blocks while
    holding it, so many threads may call at once.
    """

    _lock: threading.RLock
    _tls: threading.local
    _initialized: bool
    _ids: itertools.count[int]
    _seq: itertools.count[int]
    _addresses: AddressSpace
    _devices: list[DeviceState]

    # -- entry checks ---------------------------------------------------------
    def _ready(self, symbol: str) -> None:
        if not self._initialized:
            raise cuda_error("CUDA_ERROR_NOT_INITIALIZED", symbol, "call init() first")

    def _enter(self, method: str, symbol: str, stream: Stream | None = None) -> ContextState:
        """Check init, the calling thread's context and the capture table; return the context."""
        self._ready(symbol)
        ctx = self._current(symbol)
        capture.apply_hazards(self._captures(), method, symbol, stream, ctx.handle.value)
        return ctx

    def _current(self, symbol: str) -> ContextState:
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
    def _device(self, device: Device, symbol: str) -> DeviceState:
        if not isinstance(device, Device):
            raise UsageError(f"{symbol}: expected a Device, got {type(device).__name__}")
        if not 0 <= device.ordinal < len(self._devices):
            raise cuda_error("CUDA_ERROR_INVALID_DEVICE", symbol, f"ordinal {device.ordinal}")
        return self._devices[device.ordinal]

    def _stream(self, ctx: ContextState, stream: Stream, symbol: str) -> StreamState:
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
                state.context = ContextState(state.context_handle, self._addresses, self._seq)
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
