"""A small fake of torch 2.11's CUDA Python layer over the raw (ungated) sim driver.

It has what `capsafe.integrations.torch` touches and what `torch.cuda.graph` does with
it, in torch's shape (torch/cuda/graphs.py, streams.py, memory.py):

- `torch.cuda.CUDAGraph` with `capture_begin(pool=None, capture_error_mode="global")`,
  `capture_end()` (and, with `split=True`, the newer `capture_end_pre`/`capture_end_post`
  that `capture_end` calls), `replay()`, `reset()`;
- `torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode="global")`,
  whose `__enter__` calls `torch.cuda.synchronize()`, `torch.cuda.empty_cache()` and
  `torch._C._host_emptyCache()` by attribute lookup, enters the stream context and
  begins the capture; `__exit__` ends it (as torch's does);
- `torch.cuda.Stream` (non-blocking, as torch's pool streams), `ExternalStream`,
  `Event`, `current_stream()`, `stream(s)`, `synchronize()`, `empty_cache()` over a
  caching allocator that keeps freed blocks (`torch.cuda.memory`), and
  `is_current_stream_capturing()`.

Device work is `fill(ptr, value, n)`, a memset on the current stream (captured while
the current stream captures), and `read(ptr, n)`, which synchronizes and copies back.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

from capsafe.handles import LEGACY_STREAM, CaptureMode, CaptureStatus, DevicePtr
from capsafe.handles import Stream as SimStream
from capsafe.sim import SimBackend


def fake_torch(sim: SimBackend, *, split: bool = False) -> Any:
    """A fresh fake `torch` whose CUDA calls go to `sim` directly (no gate)."""
    tls = threading.local()
    cached: list[DevicePtr] = []  # the caching allocator's free blocks
    cached_host: list[Any] = []
    lock = threading.Lock()

    def primary() -> None:  # the runtime binds device 0's primary context on first use
        if sim.ctx_get_current() is None:
            sim.ctx_set_current(sim.primary_ctx_retain(sim.device_get(0)))

    class Stream:
        """torch.cuda.Stream: torch creates its streams with cudaStreamNonBlocking."""

        def __init__(self, device: Any = None, priority: int = 0) -> None:
            primary()
            self.handle = self._create()
            self.cuda_stream = self.handle.value

        def _create(self) -> SimStream:
            return sim.stream_create(nonblocking=True)

        def synchronize(self) -> None:
            primary()
            sim.stream_synchronize(self.handle)

        def __hash__(self) -> int:
            return hash(self.cuda_stream)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Stream) and other.cuda_stream == self.cuda_stream

    class ExternalStream(Stream):
        def __init__(self, stream_ptr: int) -> None:  # a stream torch did not create
            primary()
            self.handle = sim.stream_create(nonblocking=False)
            self.cuda_stream = self.handle.value

    class _DefaultStream(Stream):
        def _create(self) -> SimStream:
            return LEGACY_STREAM

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            primary()
            self.handle = sim.event_create()

        def record(self, stream: Any = None) -> None:
            primary()
            sim.event_record(self.handle, (stream or current_stream()).handle)

        def synchronize(self) -> None:
            primary()
            sim.event_synchronize(self.handle)

    default: list[Any] = [None]

    def current_stream(device: Any = None) -> Any:
        current = getattr(tls, "stream", None)
        if current is not None:
            return current
        if default[0] is None:
            default[0] = _DefaultStream()
        return default[0]

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        previous = getattr(tls, "stream", None)
        tls.stream = s
        try:
            yield
        finally:
            tls.stream = previous

    def synchronize(device: Any = None) -> None:  # cudaDeviceSynchronize
        primary()
        sim.ctx_synchronize()

    def empty_cache() -> None:  # the caching allocator gives its free blocks back: cudaFree
        primary()
        with lock:
            blocks, cached[:] = list(cached), []
        for ptr in blocks:
            sim.mem_free(ptr)

    def host_empty_cache() -> None:  # the pinned host allocator's free blocks: cudaFreeHost
        primary()
        with lock:
            blocks, cached_host[:] = list(cached_host), []
        for host in blocks:
            sim.mem_free_host(host)

    def caching_alloc(n: int) -> DevicePtr:
        """A block from the cache, else cudaMalloc (from C++ in torch: never gated)."""
        primary()
        with lock:
            for i, ptr in enumerate(cached):
                if ptr.size == n:
                    return cached.pop(i)
        return sim.mem_alloc(n)

    def caching_free(ptr: DevicePtr) -> None:
        with lock:
            cached.append(ptr)

    def cache_host_block(host: Any) -> None:  # a pinned block freed back to torch's cache
        with lock:
            cached_host.append(host)

    def is_current_stream_capturing() -> bool:
        primary()
        handle = current_stream().handle
        if handle.value == LEGACY_STREAM.value:
            return False
        return sim.stream_is_capturing(handle) is not CaptureStatus.NONE

    def fill(ptr: DevicePtr, value: int, n: int) -> None:
        primary()
        sim.memset_d8_async(ptr, value, n, current_stream().handle)

    def read(ptr: DevicePtr, n: int) -> bytes:
        primary()
        current_stream().synchronize()
        out = bytearray(n)
        sim.memcpy_dtoh(out, ptr, n)
        return bytes(out)

    class _CUDAGraph:
        """torch._C._CUDAGraph: the C++ side."""

        def __init__(self, keep_graph: bool = False) -> None:
            self._stream: Any = None
            self._graph: Any = None
            self._exec: Any = None

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            primary()
            mode = CaptureMode.parse(capture_error_mode)  # torch refuses other strings too
            self._stream = current_stream()
            sim.stream_begin_capture(self._stream.handle, mode)

        def _end(self) -> None:
            primary()
            self._graph = sim.stream_end_capture(self._stream.handle)

        def _instantiate(self) -> None:
            self._exec = sim.graph_instantiate(self._graph)
            sim.graph_destroy(self._graph)
            self._graph = None

        def capture_end(self) -> None:
            self._end()
            self._instantiate()

        def capture_end_pre(self) -> None:
            self._end()

        def capture_end_post(self) -> None:
            pass

        def instantiate(self) -> None:
            self._instantiate()

        def replay(self) -> None:
            primary()
            sim.graph_launch(self._exec, current_stream().handle)

        def reset(self) -> None:
            if self._exec is not None:
                sim.graph_exec_destroy(self._exec)
                self._exec = None

    if split:

        class CUDAGraph(_CUDAGraph):
            def capture_begin(
                self,
                pool: Any = None,
                capture_error_mode: str = "global",
                check_input_liveness: bool = False,
            ) -> None:
                super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)

            def capture_end_pre(self) -> None:
                super().capture_end_pre()

            def capture_end_post(self) -> None:
                super().capture_end_post()

            def capture_end(self) -> None:
                self.capture_end_pre()
                self.instantiate()
                self.capture_end_post()

    else:

        class CUDAGraph(_CUDAGraph):  # type: ignore[no-redef]
            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
                super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)

            def capture_end(self) -> None:
                super().capture_end()

    class graph:
        default_capture_stream: Any = None

        def __init__(
            self,
            cuda_graph: Any,
            pool: Any = None,
            stream: Any = None,
            capture_error_mode: str = "global",
        ) -> None:
            if stream is None and graph.default_capture_stream is None:
                graph.default_capture_stream = cuda.Stream()
            self.pool = () if pool is None else (pool,)
            self.capture_stream = stream if stream is not None else graph.default_capture_stream
            self.stream_ctx = cuda.stream(self.capture_stream)
            self.cuda_graph = cuda_graph
            self.capture_error_mode = capture_error_mode

        def __enter__(self) -> None:
            cuda.synchronize()
            cuda.empty_cache()
            torch._C._host_emptyCache()
            self.stream_ctx.__enter__()
            self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

        def __exit__(self, *args: object) -> None:
            self.cuda_graph.capture_end()
            self.stream_ctx.__exit__(*args)

    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    memory = types.ModuleType("torch.cuda.memory")
    c_module = types.ModuleType("torch._C")
    memory.empty_cache = empty_cache  # type: ignore[attr-defined]
    c_module._host_emptyCache = host_empty_cache  # type: ignore[attr-defined]
    c_module._CUDAGraph = _CUDAGraph  # type: ignore[attr-defined]
    for name, value in {
        "Stream": Stream,
        "ExternalStream": ExternalStream,
        "Event": Event,
        "CUDAGraph": CUDAGraph,
        "graph": graph,
        "current_stream": current_stream,
        "stream": stream,
        "synchronize": synchronize,
        "empty_cache": empty_cache,
        "is_current_stream_capturing": is_current_stream_capturing,
        "memory": memory,
        "caching_alloc": caching_alloc,
        "caching_free": caching_free,
        "cache_host_block": cache_host_block,
        "fill": fill,
        "read": read,
    }.items():
        setattr(cuda, name, value)
    torch.cuda = cuda  # type: ignore[attr-defined]
    torch._C = c_module  # type: ignore[attr-defined]
    return torch
