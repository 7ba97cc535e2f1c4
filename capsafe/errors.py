"""Exceptions raised by capsafe.

Every driver failure is a `CudaError` carrying the `CUresult` name and the call
that produced it, so a log line says what failed without a debugger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CapsafeError(Exception):
    """Base class for everything capsafe raises on purpose."""


class UsageError(CapsafeError, ValueError):
    """The caller asked for something that cannot be: a bad name, ordinal or setting."""


class FrameworkNotInstalled(CapsafeError, ImportError):
    """An integration's `install()` without its framework (CuPy, cuda.core, PyTorch)."""


class BackendUnavailable(CapsafeError, RuntimeError):
    """The requested driver backend cannot run on this machine (no driver, no device)."""


class ForkedProcessError(CapsafeError, RuntimeError):
    """A CUDA context created before `os.fork` was used in the child, where it is dead."""


class CudaError(CapsafeError, RuntimeError):
    """A driver call failed. `result` is the CUresult name, e.g. CUDA_ERROR_INVALID_VALUE."""

    def __init__(self, result: str, call: str, detail: str = "") -> None:
        self.result = result
        self.call = call
        self.detail = detail
        message = f"{call} failed: {result}"
        if detail:
            message += f" ({detail})"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[CudaError], tuple[str, str, str]]:
        # keep pickling (xdist, multiprocessing) exact, subclass included
        return (type(self), (self.result, self.call, self.detail))


class CaptureInvalidated(CudaError):
    """CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: something outside the capture broke it."""


def cuda_error(result: str, call: str, detail: str = "") -> CudaError:
    """Build the right `CudaError` subclass for a CUresult name."""
    cls = CaptureInvalidated if result == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED" else CudaError
    return cls(result, call, detail)


def raised_here(exc: BaseException, called: Callable[..., Any]) -> bool:
    """True when `exc`, caught around one call of `called`, did not come from inside it.

    In a `try` around that one call, it means an asynchronous exception (a signal:
    CPython runs the handler when a call returns) landed after the call returned,
    so what the call did must be undone or finished by the catching frame. The
    traceback tells: its next frame is `called`'s own when it came from inside,
    else none (a handler written in C) or the signal handler's.
    """
    tb = exc.__traceback__
    if tb is None or tb.tb_next is None:
        return True
    code = getattr(getattr(called, "__func__", called), "__code__", None)
    return tb.tb_next.tb_frame.f_code is not code
