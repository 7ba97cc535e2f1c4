"""Modules and kernels: which images load, which launches are legal, and kernel stand-ins.

A launch is an opaque stream operation unless a Python stand-in is registered
for the kernel's name; the stand-in then runs when the launch executes, and
reads and writes device memory through `SimMemory`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from capsafe import _state
from capsafe.backend import Dim3, KernelArg, is_binary_image
from capsafe.errors import cuda_error
from capsafe.handles import DevicePtr
from capsafe.sim.calibration import DEVICE_ATTRIBUTES, DRIVER_VERSION, MAX_PTX_ISA
from capsafe.sim.memory import ContextMemory, write_spans


class SimMemory:
    """The device memory a kernel stand-in sees: read and write by device pointer."""

    def __init__(self, memory: ContextMemory, kernel: str) -> None:
        self._memory, self._kernel = memory, kernel

    def read(self, ptr: DevicePtr | int, n: int) -> bytes:
        spans = self._memory.resolve(int(ptr), n, self._symbol, "CUDA_ERROR_ILLEGAL_ADDRESS")
        return b"".join(backing.read(offset, length) for backing, offset, length in spans)

    def write(self, ptr: DevicePtr | int, data: Any) -> None:
        view = memoryview(data).cast("B")
        spans = self._memory.resolve(
            int(ptr), view.nbytes, self._symbol, "CUDA_ERROR_ILLEGAL_ADDRESS"
        )
        write_spans(spans, view)

    @property
    def _symbol(self) -> str:
        return f"cuLaunchKernel({self._kernel})"


KernelStandIn = Callable[[SimMemory, Dim3, Dim3, Sequence[KernelArg]], None]
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


def standin(name: str) -> KernelStandIn | None:
    with _kernels_lock:
        return _kernels.get(name)


_PTX_VERSION = re.compile(rb"^\s*\.version\s+(\d+)\.(\d+)", re.MULTILINE)
_PTX_ENTRY = re.compile(
    rb"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$%][\w$]*)", re.MULTILINE
)


@dataclass(eq=False)
class ModuleState:
    names: frozenset[str] | None  # PTX entries; None for binaries (searched by name)
    image: bytes

    def has_kernel(self, name: str) -> bool:
        if self.names is not None:
            return name in self.names
        return b"\x00" + name.encode() + b"\x00" in self.image


def parse_image(image: bytes) -> ModuleState:
    """Accept what cuModuleLoadData accepts: PTX text, a CUBIN (ELF) or a fatbin."""
    if is_binary_image(image):
        return ModuleState(None, image)
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
    return ModuleState(names, image)


def _dim3(value: Sequence[int]) -> Dim3 | None:
    dims = tuple(int(v) for v in value)
    return (dims[0], dims[1], dims[2]) if len(dims) == 3 else None


def check_launch(
    grid: Sequence[int], block: Sequence[int], shared_mem: int, symbol: str
) -> tuple[Dim3, Dim3]:
    """The grid and block as int triples, after refusing what compute capability 9.0 refuses."""
    limits = DEVICE_ATTRIBUTES
    grid_max = (limits["MAX_GRID_DIM_X"], limits["MAX_GRID_DIM_Y"], limits["MAX_GRID_DIM_Z"])
    block_max = (limits["MAX_BLOCK_DIM_X"], limits["MAX_BLOCK_DIM_Y"], limits["MAX_BLOCK_DIM_Z"])
    grid3, block3 = _dim3(grid), _dim3(block)
    if (
        grid3 is None
        or block3 is None
        or not all(1 <= v <= m for v, m in zip(grid3, grid_max, strict=True))
        or not all(1 <= v <= m for v, m in zip(block3, block_max, strict=True))
        or block3[0] * block3[1] * block3[2] > limits["MAX_THREADS_PER_BLOCK"]
    ):
        shown = tuple(int(v) for v in grid), tuple(int(v) for v in block)
        raise cuda_error(
            "CUDA_ERROR_INVALID_VALUE",
            symbol,
            f"grid {shown[0]} / block {shown[1]} outside the device limits",
        )
    if not 0 <= shared_mem <= limits["MAX_SHARED_MEMORY_PER_BLOCK"]:
        raise cuda_error(
            "CUDA_ERROR_INVALID_VALUE",
            symbol,
            f"{shared_mem} bytes of dynamic shared memory exceed the 48 KiB default",
        )
    return grid3, block3


@_state.on_fork
def _after_fork_in_child() -> None:
    # A thread that held the lock at fork time does not exist in the child: a fresh lock.
    global _kernels_lock
    _kernels_lock = threading.Lock()
