"""`TestStream`: one non-blocking stream through which a device test does everything.

A test that fills on one stream and reads back with a synchronous copy is
reading on the legacy default stream, which does not wait for non-blocking
streams: the read can return bytes from before the fill, with no error. It
passes whenever something else happened to synchronize first (a warm context,
a slower neighbour) and fails in the suite. Putting every fill, write, read and
launch on one stream makes stream order the only order, so one synchronize
covers all of it; `read` synchronizes before it returns.

Allocations and frees go through the driver facade, so under the capture gate
they wait for an open capture instead of invalidating it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capsafe.backend import Backend, Dim3, KernelArg
from capsafe.errors import UsageError
from capsafe.handles import DevicePtr, Function, Stream


class TestStream:
    """Context manager owning one non-blocking stream and what was allocated through it.

    `TestStream()` binds `capsafe.device(device)` in the entering thread and uses the
    process-wide driver; `TestStream(backend)` uses a backend whose context the caller
    has already bound. Leaving the block synchronizes the stream, frees the
    allocations and destroys the stream, even when the block raised.
    """

    __test__ = False  # a library class, not a pytest test class

    def __init__(self, backend: Backend | None = None, *, device: int = 0) -> None:
        self._requested = backend
        self._device = device
        self._backend: Backend | None = None
        self._stream: Stream | None = None
        self._allocations: list[DevicePtr] = []
        self._pending_sources: list[bytes] = []

    # -- lifetime ---------------------------------------------------------------
    def __enter__(self) -> TestStream:
        if self._stream is not None:
            raise UsageError("this TestStream is already open; create one per block")
        if self._requested is None:
            from capsafe.context import device

            backend = device(self._device).backend
        else:
            backend = self._requested
        self._stream = backend.stream_create(nonblocking=True)
        self._backend = backend
        return self

    def __exit__(self, *exc_info: object) -> None:
        backend, stream = self._open()
        try:
            self.synchronize()
        finally:
            allocations, self._allocations = self._allocations, []
            try:
                for ptr in reversed(allocations):
                    backend.mem_free(ptr)
            finally:
                self._stream = None
                self._pending_sources.clear()
                backend.stream_destroy(stream)

    def _open(self) -> tuple[Backend, Stream]:
        if self._stream is None or self._backend is None:
            raise UsageError("TestStream used outside its `with` block")
        return self._backend, self._stream

    # -- what a test does ---------------------------------------------------------
    @property
    def raw(self) -> Stream:
        """The stream handle, for calls this class does not wrap (keep them on this stream)."""
        return self._open()[1]

    @property
    def backend(self) -> Backend:
        return self._open()[0]

    def alloc(self, size: int) -> DevicePtr:
        """Device memory freed when the block ends."""
        backend, _ = self._open()
        ptr = backend.mem_alloc(size)
        self._allocations.append(ptr)
        return ptr

    def fill(self, ptr: DevicePtr, value: int, count: int | None = None) -> None:
        """Set `count` bytes (default: the whole allocation) to `value`, on this stream."""
        backend, stream = self._open()
        backend.memset_d8_async(ptr, value, ptr.size if count is None else count, stream)

    def write(self, ptr: DevicePtr, data: Any) -> None:
        """Copy host bytes to the device, on this stream; `data` may be reused at once."""
        backend, stream = self._open()
        source = bytes(memoryview(data).cast("B"))
        self._pending_sources.append(source)  # alive until the copy is known done
        backend.memcpy_htod_async(ptr, source, stream)

    def read(self, ptr: DevicePtr, size: int | None = None) -> bytes:
        """The device bytes after everything queued so far on this stream."""
        backend, stream = self._open()
        out = bytearray(ptr.size if size is None else size)
        backend.memcpy_dtoh_async(out, ptr, stream, len(out))
        self.synchronize()
        return bytes(out)

    def launch(
        self,
        function: Function,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        shared_mem: int = 0,
    ) -> None:
        """Launch a kernel on this stream."""
        backend, stream = self._open()
        backend.launch_kernel(function, grid, block, args, stream, shared_mem)

    def synchronize(self) -> None:
        """Wait for everything queued on this stream."""
        backend, stream = self._open()
        backend.stream_synchronize(stream)
        self._pending_sources.clear()
