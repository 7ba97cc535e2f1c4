"""A torch whose CUDA calls do nothing, in torch 2.13's Python shape, for `torch_protect.py --null`.

What a protected `torch.cuda.graph` capture costs beyond torch itself is the
integration's own Python between torch's calls; over this null torch that is all a
capture costs, so it can be timed and its Python calls counted on a machine without a
GPU. The shape follows torch/cuda/graphs.py: `CUDAGraph` is a Python subclass of the C
class whose `capture_begin`/`capture_end` call `super()`, and `graph.__enter__`
synchronizes, empties both caches, enters the capture stream's context and begins the
capture; `__exit__` ends it and leaves the stream context.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CUDAGraph:  # torch._C._CUDAGraph: C methods there, no-ops here
    def capture_begin(
        self,
        pool: Any = None,
        capture_error_mode: str = "global",
        check_input_liveness: bool = False,
    ) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass


class CUDAGraph(_CUDAGraph):
    def capture_begin(
        self,
        pool: Any = None,
        capture_error_mode: str = "global",
        check_input_liveness: bool = False,
    ) -> None:
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)

    def capture_end(self) -> None:
        super().capture_end()


class Stream:
    cuda_stream = 0

    def synchronize(self) -> None:
        pass


class Event:
    def synchronize(self) -> None:
        pass


class _StreamContext:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def make() -> types.ModuleType:
    """A fresh null `torch` with `torch.cuda`, `torch.cuda.memory` and `torch._C`."""
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    memory = types.ModuleType("torch.cuda.memory")
    c_module = types.ModuleType("torch._C")
    torch.cuda, torch._C, cuda.memory = cuda, c_module, memory  # type: ignore[attr-defined]
    torch.__version__ = "null"  # type: ignore[attr-defined]
    default = Stream()

    def nothing(*args: Any, **kwargs: Any) -> None:
        pass

    class graph:
        def __init__(
            self, cuda_graph: CUDAGraph, pool: Any = None, stream: Stream | None = None,
            capture_error_mode: str = "global",
        ) -> None:  # fmt: skip
            self.pool = () if pool is None else (pool,)
            self.stream_ctx = _StreamContext(stream if stream is not None else default)
            self.cuda_graph, self.capture_error_mode = cuda_graph, capture_error_mode

        def __enter__(self) -> None:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
            self.stream_ctx.__enter__()
            pool = self.pool[0] if self.pool else None  # torch passes `*self.pool`
            self.cuda_graph.capture_begin(
                pool, capture_error_mode=self.capture_error_mode, check_input_liveness=False
            )

        def __exit__(self, *exc: object) -> None:
            self.cuda_graph.capture_end()
            self.stream_ctx.__exit__(*exc)

    cuda.CUDAGraph, cuda.Stream, cuda.Event, cuda.graph = CUDAGraph, Stream, Event, graph  # type: ignore[attr-defined]
    cuda.synchronize = cuda.empty_cache = memory.empty_cache = nothing  # type: ignore[attr-defined]
    c_module._host_emptyCache = nothing  # type: ignore[attr-defined]
    cuda.is_current_stream_capturing = lambda: False  # type: ignore[attr-defined]
    cuda.current_stream = lambda device=None: default  # type: ignore[attr-defined]
    cuda.is_available = lambda: False  # type: ignore[attr-defined]
    return torch


def install() -> types.ModuleType:
    """Put a null torch in `sys.modules` (refused when a real torch is already imported)."""
    if "torch" in sys.modules and not getattr(sys.modules["torch"], "__version__", "") == "null":
        raise RuntimeError("a real torch is already imported: the null torch cannot replace it")
    torch = make()
    sys.modules.update(
        {
            "torch": torch,
            "torch.cuda": torch.cuda,
            "torch.cuda.memory": torch.cuda.memory,
            "torch._C": torch._C,
        }
    )
    return torch
