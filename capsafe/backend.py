"""The driver interface both backends implement.

`backend_cuda.CudaBackend` calls the real driver through cuda.bindings;
`capsafe.sim.SimBackend` is an in-process model of an H200 calibrated against
the hazard table. Both take and return the typed handles of `capsafe.handles`
and raise `capsafe.errors.CudaError` (never return error tuples). Nothing above
this layer may know which backend it talks to.

Conventions shared by every method:
- the current context is per thread, as in the driver: a thread must bind one
  (`ctx_set_current`) before calls that need it, else CUDA_ERROR_INVALID_CONTEXT;
- host memory is any buffer-protocol object (`bytes`, `bytearray`,
  `memoryview`, numpy arrays); destinations must be writable;
- kernel arguments are `DevicePtr` handles or ctypes scalars (`c_int(3)`).
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Sequence
from typing import Any, TypeAlias

from capsafe.errors import UsageError
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
)

#: A launch argument. Annotation-only (a string): ctypes._SimpleCData is generic to
#: type checkers but not subscriptable at runtime on Python 3.11.
KernelArg: TypeAlias = "DevicePtr | ctypes._SimpleCData[Any]"
Dim3 = tuple[int, int, int]

ELF_MAGIC = b"\x7fELF"  # a CUBIN
FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xba55ed50, little endian


def is_binary_image(image: bytes) -> bool:
    """A CUBIN or fatbin, as opposed to PTX text (which the driver reads as a C string)."""
    return image.startswith((ELF_MAGIC, FATBIN_MAGIC))


def host_view(buffer: Any, *, writable: bool) -> memoryview:
    """A flat byte view of a host buffer, checked before the driver sees it.

    Both backends refuse the same mistakes with the same one-line message.
    """
    try:
        view = memoryview(buffer).cast("B")
    except TypeError as exc:
        raise UsageError(f"host memory must be a C-contiguous buffer ({exc})") from None
    if writable and view.readonly:
        raise UsageError(f"the destination {type(buffer).__name__} is read-only")
    return view


def check_kernel_args(args: Sequence[Any]) -> list[KernelArg]:
    """The launch arguments as a list, after refusing anything but DevicePtr and ctypes scalars."""
    out = list(args)
    for index, arg in enumerate(out):
        if not isinstance(arg, DevicePtr | ctypes._SimpleCData):
            raise UsageError(
                f"kernel argument {index} is a {type(arg).__name__}; "
                "pass a DevicePtr or a ctypes scalar such as ctypes.c_int(3)"
            )
    return out


class Backend(abc.ABC):
    """One driver. Method names follow the driver symbol they wrap, in snake case."""

    name: str  # "cuda" or "sim"

    # -- init and devices ---------------------------------------------------
    @abc.abstractmethod
    def init(self) -> None: ...

    @abc.abstractmethod
    def driver_version(self) -> int:
        """cuDriverGetVersion, e.g. 13000."""

    @abc.abstractmethod
    def device_get_count(self) -> int: ...

    @abc.abstractmethod
    def device_get(self, ordinal: int) -> Device: ...

    @abc.abstractmethod
    def device_get_name(self, device: Device) -> str: ...

    @abc.abstractmethod
    def device_get_attribute(self, device: Device, attribute: str) -> int:
        """`attribute` is the CU_DEVICE_ATTRIBUTE_ suffix, e.g. "COMPUTE_CAPABILITY_MAJOR"."""

    # -- contexts -----------------------------------------------------------
    @abc.abstractmethod
    def primary_ctx_retain(self, device: Device) -> Context: ...

    @abc.abstractmethod
    def primary_ctx_release(self, device: Device) -> None: ...

    @abc.abstractmethod
    def ctx_set_current(self, context: Context | None) -> None: ...

    @abc.abstractmethod
    def ctx_get_current(self) -> Context | None: ...

    @abc.abstractmethod
    def ctx_synchronize(self) -> None: ...

    # -- streams and capture ------------------------------------------------
    @abc.abstractmethod
    def stream_create(self, nonblocking: bool = True) -> Stream: ...

    @abc.abstractmethod
    def stream_destroy(self, stream: Stream) -> None: ...

    @abc.abstractmethod
    def stream_synchronize(self, stream: Stream) -> None: ...

    @abc.abstractmethod
    def stream_query(self, stream: Stream) -> bool:
        """True when all work is done (CUDA_SUCCESS), False for CUDA_ERROR_NOT_READY."""

    @abc.abstractmethod
    def stream_is_capturing(self, stream: Stream) -> CaptureStatus: ...

    @abc.abstractmethod
    def stream_wait_event(self, stream: Stream, event: Event) -> None: ...

    @abc.abstractmethod
    def stream_begin_capture(self, stream: Stream, mode: CaptureMode) -> None: ...

    @abc.abstractmethod
    def stream_end_capture(self, stream: Stream) -> Graph: ...

    @abc.abstractmethod
    def graph_instantiate(self, graph: Graph) -> GraphExec: ...

    @abc.abstractmethod
    def graph_launch(self, graph_exec: GraphExec, stream: Stream) -> None: ...

    @abc.abstractmethod
    def graph_exec_destroy(self, graph_exec: GraphExec) -> None: ...

    @abc.abstractmethod
    def graph_destroy(self, graph: Graph) -> None: ...

    # -- events -------------------------------------------------------------
    @abc.abstractmethod
    def event_create(self, timing: bool = False) -> Event: ...

    @abc.abstractmethod
    def event_record(self, event: Event, stream: Stream) -> None: ...

    @abc.abstractmethod
    def event_synchronize(self, event: Event) -> None: ...

    @abc.abstractmethod
    def event_query(self, event: Event) -> bool: ...

    @abc.abstractmethod
    def event_destroy(self, event: Event) -> None: ...

    # -- memory -------------------------------------------------------------
    @abc.abstractmethod
    def mem_alloc(self, size: int) -> DevicePtr: ...

    @abc.abstractmethod
    def mem_free(self, ptr: DevicePtr) -> None: ...

    @abc.abstractmethod
    def mem_alloc_async(self, size: int, stream: Stream) -> DevicePtr: ...

    @abc.abstractmethod
    def mem_free_async(self, ptr: DevicePtr, stream: Stream) -> None: ...

    @abc.abstractmethod
    def mem_host_alloc(self, size: int) -> HostPtr: ...

    @abc.abstractmethod
    def mem_free_host(self, ptr: HostPtr) -> None: ...

    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes on the current context's device."""

    @abc.abstractmethod
    def memcpy_htod(self, dst: DevicePtr, src: Any) -> None: ...

    @abc.abstractmethod
    def memcpy_dtoh(self, dst: Any, src: DevicePtr, size: int | None = None) -> None:
        """Copy `size` bytes (default: len(dst)) from the device into writable `dst`."""

    @abc.abstractmethod
    def memcpy_htod_async(self, dst: DevicePtr, src: Any, stream: Stream) -> None: ...

    @abc.abstractmethod
    def memcpy_dtoh_async(
        self, dst: Any, src: DevicePtr, stream: Stream, size: int | None = None
    ) -> None: ...

    @abc.abstractmethod
    def memset_d8(self, ptr: DevicePtr, value: int, count: int) -> None: ...

    @abc.abstractmethod
    def memset_d8_async(self, ptr: DevicePtr, value: int, count: int, stream: Stream) -> None: ...

    # -- modules and kernels ------------------------------------------------
    @abc.abstractmethod
    def module_load_data(self, image: bytes) -> Module:
        """Load PTX (NUL-terminated or not) or a CUBIN/fatbin image."""

    @abc.abstractmethod
    def module_get_function(self, module: Module, name: str) -> Function: ...

    @abc.abstractmethod
    def module_unload(self, module: Module) -> None: ...

    @abc.abstractmethod
    def launch_kernel(
        self,
        function: Function,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        stream: Stream,
        shared_mem: int = 0,
    ) -> None: ...

    # -- virtual memory management -----------------------------------------
    @abc.abstractmethod
    def mem_get_allocation_granularity(self, device: Device) -> int: ...

    @abc.abstractmethod
    def mem_create(self, size: int, device: Device) -> MemHandle: ...

    @abc.abstractmethod
    def mem_address_reserve(self, size: int, alignment: int = 0) -> DevicePtr: ...

    @abc.abstractmethod
    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None: ...

    @abc.abstractmethod
    def mem_set_access(self, ptr: DevicePtr, size: int, device: Device) -> None:
        """Grant read/write access to `device` over the mapped range."""

    @abc.abstractmethod
    def mem_unmap(self, ptr: DevicePtr, size: int) -> None: ...

    @abc.abstractmethod
    def mem_release(self, handle: MemHandle) -> None: ...

    @abc.abstractmethod
    def mem_address_free(self, ptr: DevicePtr, size: int) -> None: ...
