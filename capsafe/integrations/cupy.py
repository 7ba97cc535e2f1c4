"""CuPy through the capture gate, with no change to the code that uses CuPy.

`install()` (idempotent; `uninstall()` or the `installed()` context manager undo it):

- device memory: a new `cupy.cuda.MemoryPool` becomes CuPy's allocator and
  default pool. Its base allocator is a `PythonFunctionAllocator` whose malloc
  and free are CuPy's runtime calls inside the gate (`GatedAllocator`): pool hits
  never touch the gate, pool growth and release take its shared side, and a
  release the capturing thread triggers inside its own window is deferred to the
  window's end;
- pinned memory: likewise through a `PinnedMemoryPool` over `mem_host_alloc` /
  `mem_free_host`, set with `set_pinned_memory_allocator`;
- captures: `Stream.begin_capture` / `end_capture` (defined on CuPy's plain-Python
  `_BaseStream`, so every `Stream` and `ExternalStream` sees the replacement) take
  the gate's exclusive side for the whole window; `end_capture` releases it, also
  when it raises.

`capture(stream, mode)` is the same window as a `with` block for new code, with
or without `install()`. CuPy is imported by these calls only, never by importing
this module.
"""

from __future__ import annotations

import functools
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from capsafe import driver as _driver
from capsafe.backend import Backend
from capsafe.errors import CudaError, raised_here
from capsafe.gate import CaptureGate
from capsafe.handles import CaptureMode, Context, HostPtr, StreamKind

from ._capture_windows import Windows, exclusive
from ._installer import Installer
from ._patch import Patches, defining_class

#: Driver errors whose CUDA runtime error has the same number: re-raised as CuPy's own
#: CUDARuntimeError, so CuPy's pool still frees cached blocks and retries on out-of-memory
#: and a capture-breaking allocation reads as CuPy users expect.
RUNTIME_CODES = {
    "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": 900,
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": 901,
    "CUDA_ERROR_STREAM_CAPTURE_MERGE": 902,
    "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED": 903,
    "CUDA_ERROR_STREAM_CAPTURE_UNJOINED": 904,
    "CUDA_ERROR_STREAM_CAPTURE_ISOLATION": 905,
    "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT": 906,
    "CUDA_ERROR_CAPTURED_EVENT": 907,
    "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD": 908,
}
_MODE_NAMES = {
    CaptureMode.GLOBAL: "streamCaptureModeGlobal",
    CaptureMode.THREAD_LOCAL: "streamCaptureModeThreadLocal",
    CaptureMode.RELAXED: "streamCaptureModeRelaxed",
}

windows = Windows()  # captures begun through the hooks or `capture()`, by stream pointer


def _cupy() -> Any:
    return importlib.import_module("cupy")


def _device_memory(
    runtime: Any, gate: CaptureGate | None
) -> tuple[Callable[[int, int], int], Callable[[int, int], None]]:
    """(malloc, free) for `PythonFunctionAllocator`: the runtime's, inside `gate`."""
    rt_malloc, rt_free = runtime.malloc, runtime.free
    if gate is None:  # an ungated facade: nothing to keep out of capture windows
        return (lambda size, _device: rt_malloc(size)), (lambda ptr, _device: rt_free(ptr))
    enter, exit_, defer = gate.enter, gate.exit, gate.defer_if_capturing

    def malloc(size: int, _device: int) -> int:
        enter("mem_alloc")
        try:
            return int(rt_malloc(size))
        finally:
            exit_()

    def release(ptr: int) -> None:
        enter("mem_free")
        try:
            rt_free(ptr)
        finally:
            exit_()

    def free(ptr: int, _device: int) -> None:
        if not defer(release, ptr):
            release(ptr)

    return malloc, free


class GatedAllocator:
    """Device and pinned memory for CuPy's pools, allocated and freed inside the gate.

    Device memory is CuPy's own `cudaMalloc`/`cudaFree` (`cupy.cuda.runtime`, the
    calls its default pool makes) inside the shared side of `driver`'s gate, named
    `mem_alloc`/`mem_free` as the hazard table names cuMemAlloc/cuMemFree, which
    they call; a free the capturing thread triggers inside its window waits for the
    window's end. The typed facade's cuMemAlloc/cuMemFree cost pool growth 1.08-1.12x
    on the H200, this path 1.03x: the gate is what protects a capture, the handles add
    nothing here. Pinned memory (no hot path) goes through the facade.
    """

    def __init__(self, cupy: Any, driver: Backend) -> None:
        self._cupy = cupy
        self._driver = driver
        self._contexts: dict[int, Context] = {}
        self._tls = threading.local()
        self._lock = threading.Lock()
        malloc, free = _device_memory(cupy.cuda.runtime, getattr(driver, "gate", None))
        self.malloc: Callable[[int], Any] = cupy.cuda.PythonFunctionAllocator(malloc, free).malloc

    def _bind(self, device_id: int) -> None:
        # CuPy calls its allocator with `device_id` current; the runtime may not have
        # made that device's primary context current on this thread yet.
        if getattr(self._tls, "device", None) == device_id:
            return
        if self._driver.ctx_get_current() is None:
            context = self._contexts.get(device_id)
            if context is None:
                with self._lock:
                    context = self._contexts.get(device_id)
                    if context is None:  # retained once, never released (see capsafe.context)
                        device = self._driver.device_get(device_id)
                        context = self._contexts[device_id] = self._driver.primary_ctx_retain(
                            device
                        )
            self._driver.ctx_set_current(context)
        self._tls.device = device_id

    def _runtime_error(self, exc: CudaError) -> BaseException:
        code = RUNTIME_CODES.get(exc.result)
        return exc if code is None else self._cupy.cuda.runtime.CUDARuntimeError(code)

    def pinned(self, size: int) -> Any:
        """A `PinnedMemoryPointer` to `size` new bytes of page-locked host memory."""
        device_id = self._cupy.cuda.get_device_id()
        self._bind(device_id)
        try:
            memory = GatedPinnedMemory(size, self._driver.mem_host_alloc(size) if size else None)
        except CudaError as exc:
            raise self._runtime_error(exc) from exc
        if memory.host is not None:
            release = weakref.finalize(memory, self._host_free, memory.host, device_id)
            release.atexit = False  # the process exit frees it; the driver may be gone by then
        return self._cupy.cuda.PinnedMemoryPointer(memory, 0)

    def _host_free(self, host: HostPtr, device_id: int) -> None:
        self._bind(device_id)
        self._driver.mem_free_host(host)


class GatedPinnedMemory:
    """Page-locked host memory in the shape CuPy's pinned pool expects (`ptr`, `size`)."""

    def __init__(self, size: int, host: HostPtr | None) -> None:
        self.size = size
        self.host = host
        self.ptr = 0 if host is None else host.value

    def __int__(self) -> int:
        return self.ptr


def _mode(cupy: Any, mode: Any) -> CaptureMode:
    """The capsafe mode of a CuPy mode (None: CuPy's default, relaxed; an int; a name)."""
    if mode is None:
        return CaptureMode.RELAXED
    if isinstance(mode, str):
        return CaptureMode.parse(mode)
    for ours, name in _MODE_NAMES.items():
        if mode == getattr(cupy.cuda.runtime, name):
            return ours
    return CaptureMode.GLOBAL  # CuPy will refuse it; the strictest rules meanwhile


def _kind(stream: Any) -> StreamKind:
    return StreamKind.NONBLOCKING if stream.is_non_blocking else StreamKind.BLOCKING


def _taker(driver: Backend, cupy: Any, stream: Any, mode: Any) -> Callable[[list[Any]], None]:
    """What takes the exclusive side for a capture on `stream` (see `Windows.begin`)."""
    ours = _mode(cupy, mode)
    label = f"CuPy stream {stream.ptr:#x} ({ours})"
    return lambda into: exclusive(driver, ours, lambda: _kind(stream), label, into)


def _begin_window(
    driver: Backend, cupy: Any, stream: Any, mode: Any, begin: Any, end: Any, hooked: bool
) -> None:
    """`begin(stream, mode)` in a window; when this raises, nothing began and nothing is held."""
    take = _taker(driver, cupy, stream, mode)
    abort = functools.partial(end, stream)
    try:
        windows.begin(
            stream.ptr,
            take,
            functools.partial(begin, stream, mode),
            abort,
            stream.is_capturing,
            hooked=hooked,
        )
    except BaseException as exc:
        if raised_here(exc, Windows.begin):  # it landed after the window opened: close it again
            windows.undo_begin(stream.ptr, abort, stream.is_capturing)
        raise


class _Installation:
    """What `install()` changed, so `uninstall()` can put it back."""

    def __init__(self, cupy: Any, driver: Backend) -> None:
        cuda = cupy.cuda
        self.cupy = cupy
        self.allocator = GatedAllocator(cupy, driver)
        self.pool = cuda.MemoryPool(self.allocator.malloc)
        self.pinned_pool = cuda.PinnedMemoryPool(self.allocator.pinned)
        self.previous_allocator = cuda.get_allocator()
        self.previous_pool = cupy._default_memory_pool
        self.previous_pinned_pool = cupy._default_pinned_memory_pool
        self.patches = Patches()
        owner = defining_class(cuda.Stream, "begin_capture")
        begin = self.original_begin = owner.__dict__["begin_capture"]
        end = self.original_end = defining_class(cuda.Stream, "end_capture").__dict__["end_capture"]

        def begin_capture(stream: Any, mode: Any = None) -> None:
            try:
                _begin_window(driver, cupy, stream, mode, begin, end, True)
            except BaseException as exc:
                if raised_here(
                    exc, _begin_window
                ):  # it landed after the window opened: close it again
                    windows.undo_begin(
                        stream.ptr, functools.partial(end, stream), stream.is_capturing
                    )
                raise

        def end_capture(stream: Any) -> Any:
            # Inline, not a helper: a signal at a helper's entry would end nothing.
            try:
                result = windows.end(
                    stream.ptr, functools.partial(end, stream), stream.is_capturing
                )
            except BaseException as exc:
                if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
                    windows.finish(stream.ptr, functools.partial(end, stream), stream.is_capturing)
                raise
            return result

        begin_capture.__doc__, end_capture.__doc__ = begin.__doc__, end.__doc__
        self.patches.replace(owner, "begin_capture", begin_capture)
        self.patches.replace(defining_class(cuda.Stream, "end_capture"), "end_capture", end_capture)
        windows.hooked = True
        try:  # CuPy refuses inside a `using_allocator` block on this thread
            cuda.set_allocator(self.pool.malloc)
        except BaseException:
            windows.hooked = False
            self.patches.restore()
            raise
        cuda.set_pinned_memory_allocator(self.pinned_pool.malloc)
        cupy._default_memory_pool = self.pool
        cupy._default_pinned_memory_pool = self.pinned_pool

    def undo(self) -> None:
        cupy, cuda = self.cupy, self.cupy.cuda
        self.patches.restore()
        cuda.set_allocator(self.previous_allocator)
        # CuPy has no getter for the pinned allocator: back to its default pool's.
        cuda.set_pinned_memory_allocator(self.previous_pinned_pool.malloc)
        cupy._default_memory_pool = self.previous_pool
        cupy._default_pinned_memory_pool = self.previous_pinned_pool
        self.pool.free_all_blocks()
        self.pinned_pool.free_all_blocks()


def install(driver: Backend | None = None) -> bool:
    """Route CuPy's memory and captures through the gate of `driver` (default `driver.get()`).

    Returns False when already installed (nothing changes).
    """
    return _installer.install(driver)


_installer = Installer("cupy", windows, lambda driver: _Installation(_cupy(), driver))
uninstall = _installer.uninstall
is_installed = _installer.is_installed
installed = _installer.installed


class Captured:
    """The result of a `capture()` block: `graph` is CuPy's `Graph` once the block ended."""

    graph: Any = None


@contextmanager
def capture(
    stream: Any, mode: CaptureMode | str = CaptureMode.RELAXED, *, driver: Backend | None = None
) -> Iterator[Captured]:
    """Capture CuPy work on `stream` in `mode`, holding the gate's exclusive side throughout.

        with capsafe.integrations.cupy.capture(stream, "relaxed") as cap:
            y = x * 2
        cap.graph.launch(stream)

    The stream becomes CuPy's current stream inside the block. When the body
    raises, the capture is still ended (so the stream stays usable), the graph is
    dropped and the body's error propagates.
    """
    cupy = _cupy()
    driver = driver if driver is not None else _driver.get()
    ours = CaptureMode.parse(mode)
    state = _installer.current
    begin = state.original_begin if state is not None else type(stream).begin_capture
    end = state.original_end if state is not None else type(stream).end_capture
    result = Captured()
    native = getattr(cupy.cuda.runtime, _MODE_NAMES[ours])
    take = _taker(driver, cupy, stream, ours.value)
    abort = functools.partial(end, stream)
    try:
        windows.begin(
            stream.ptr, take, functools.partial(begin, stream, native), abort, stream.is_capturing
        )
    except BaseException as exc:
        if raised_here(exc, Windows.begin):  # it landed after the window opened: close it again
            windows.undo_begin(stream.ptr, abort, stream.is_capturing)
        raise
    try:
        with stream:
            yield result
    except BaseException:
        with suppress(Exception):  # the body's error is the story; the capture is over anyway
            try:
                windows.end(stream.ptr, functools.partial(end, stream))
            except BaseException as exc:
                if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
                    windows.finish(stream.ptr, functools.partial(end, stream), stream.is_capturing)
                raise
        raise
    try:
        result.graph = windows.end(stream.ptr, functools.partial(end, stream), stream.is_capturing)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
            windows.finish(stream.ptr, functools.partial(end, stream), stream.is_capturing)
        raise
