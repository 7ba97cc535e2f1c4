"""Is this test failure a stream-capture error? For capsafe, CuPy, PyTorch and cuda.core.

A capture that another thread breaks fails with one of a few CUDA errors; each
framework wraps them its own way. An exception is matched by type first, when
the framework that defines the type is already loaded in the test process
(nothing here imports a framework), and then by the error's name or the
driver's description of it in the failure text, which also covers frameworks
not listed here and failures seen only as text (an xdist worker's report).

Stdlib only: the plugin imports this module in every test process.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

#: CUresult / cudaError_t values (the two enums agree here) and their names.
CAPTURE_ERROR_CODES: dict[int, str] = {
    900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
    901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    908: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
}

#: The runtime's names for the same errors (what CuPy and cudaGetErrorName print).
RUNTIME_NAMES: dict[str, str] = {
    "cudaErrorStreamCaptureUnsupported": CAPTURE_ERROR_CODES[900],
    "cudaErrorStreamCaptureInvalidated": CAPTURE_ERROR_CODES[901],
    "cudaErrorStreamCaptureImplicit": CAPTURE_ERROR_CODES[906],
    "cudaErrorStreamCaptureWrongThread": CAPTURE_ERROR_CODES[908],
}

#: cudaGetErrorString's descriptions: all PyTorch's messages carry ("CUDA error: <this>").
DESCRIPTIONS: dict[str, str] = {
    "operation not permitted when stream is capturing": CAPTURE_ERROR_CODES[900],
    "operation failed due to a previous error during capture": CAPTURE_ERROR_CODES[901],
    # The capture status INVALIDATED, as CuPy words it when it finds a stream in that
    # state (e.g. before a cuBLAS call): "the stream was capturing, but an error has ...".
    "an error has invalidated the capture sequence": CAPTURE_ERROR_CODES[901],
    "operation would make the legacy stream depend on a capturing blocking stream": (
        CAPTURE_ERROR_CODES[906]
    ),
    "attempt to terminate a thread-local capture sequence from another thread": (
        CAPTURE_ERROR_CODES[908]
    ),
}

#: Exception types that carry a numeric status, as (loaded module, attribute path, field).
CODED_TYPES: tuple[tuple[str, str, str], ...] = (
    ("cupy", "cuda.runtime.CUDARuntimeError", "status"),
    ("cupy", "cuda.driver.CUDADriverError", "status"),
    ("torch", "AcceleratorError", "error_code"),
)

_TEXT_MARKS: dict[str, str] = {
    **{name: name for name in CAPTURE_ERROR_CODES.values()},
    **RUNTIME_NAMES,
    **DESCRIPTIONS,
}


def capture_error(exc: BaseException | None = None, text: str = "") -> str | None:
    """The CUDA name of the capture error `exc` (or its cause chain) or `text` shows, else None."""
    for link in _chain(exc):
        found = _by_type(link) or in_text(str(link))
        if found:
            return found
    return in_text(text)


def in_text(text: str) -> str | None:
    """The capture error named (or described) in `text`, as its CUDA_ERROR_* name."""
    for mark, name in _TEXT_MARKS.items():
        if mark in text:
            return name
    return None


def _by_type(exc: BaseException) -> str | None:
    errors = sys.modules.get("capsafe.errors")
    if isinstance(exc, getattr(errors, "CaptureInvalidated", ())):
        return CAPTURE_ERROR_CODES[901]
    result = getattr(exc, "result", None)
    if isinstance(exc, getattr(errors, "CudaError", ())) and isinstance(result, str):
        return result if result in CAPTURE_ERROR_CODES.values() else None
    for module, path, field in CODED_TYPES:
        cls = _loaded(module, path)
        if isinstance(cls, type) and isinstance(exc, cls):
            code = getattr(exc, field, None)
            return CAPTURE_ERROR_CODES.get(int(code)) if isinstance(code, int) else None
    return None


def _loaded(module: str, path: str) -> object:
    """`module.path` when `module` is already imported (never imports it), else None."""
    found: object = sys.modules.get(module)
    for part in path.split("."):
        if found is None:
            return None
        found = getattr(found, part, None)
    return found


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during, without looping."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
