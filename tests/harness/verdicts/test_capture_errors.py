"""Capture errors are recognised by type when the framework is loaded, by name or text otherwise."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from capsafe.errors import CaptureInvalidated, CudaError
from capsafe_harness.plugin.capture_errors import capture_error, in_text


class _Status(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _fake_cupy(monkeypatch: pytest.MonkeyPatch) -> type[_Status]:
    cupy: Any = types.ModuleType("cupy")  # a fake of an untyped module
    runtime = types.SimpleNamespace(CUDARuntimeError=type("CUDARuntimeError", (_Status,), {}))
    cupy.cuda = types.SimpleNamespace(runtime=runtime, driver=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    error: type[_Status] = runtime.CUDARuntimeError
    return error


def test_capsafe_errors_by_their_result() -> None:
    assert capture_error(CaptureInvalidated("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "x")) == (
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
    )
    unsupported = CudaError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "cuMemAlloc")
    assert capture_error(unsupported) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert capture_error(CudaError("CUDA_ERROR_INVALID_VALUE", "cuMemAlloc")) is None
    renamed = type("Renamed", (CaptureInvalidated,), {})("CUDA_ERROR_X", "cuStreamEndCapture")
    assert capture_error(renamed) == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"  # by its type


def test_cupy_error_by_type_when_cupy_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    error = _fake_cupy(monkeypatch)
    # The status alone says what it is: the message names nothing.
    assert capture_error(error("graph failed", 908)) == "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"
    assert capture_error(error("out of memory", 2)) is None


def test_cupy_error_by_name_when_cupy_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    exc = _Status("cudaErrorStreamCaptureInvalidated: operation failed due to a previous", 0)
    assert capture_error(exc) == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"


def test_torch_error_by_code_and_by_description(monkeypatch: pytest.MonkeyPatch) -> None:
    torch: Any = types.ModuleType("torch")  # a fake of an untyped module
    torch.AcceleratorError = type("AcceleratorError", (RuntimeError,), {})
    monkeypatch.setitem(sys.modules, "torch", torch)
    exc = torch.AcceleratorError("CUDA error: something")
    exc.error_code = 906
    assert capture_error(exc) == "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"
    text = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert capture_error(RuntimeError(text)) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"


def test_cause_chain_and_text_only() -> None:
    try:
        try:
            raise CaptureInvalidated("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "cuStreamEndCapture")
        except CudaError as inner:
            raise AssertionError("graph was not built") from inner
    except AssertionError as outer:
        assert capture_error(outer) == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
    cuda_core = "CUDAError: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: operation not permitted"
    assert in_text(cuda_core) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert capture_error(ValueError("bad shape"), "assert 1 == 2") is None


def test_cupy_invalidated_capture_status_as_a_runtime_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CuPy's own wording when it finds a stream whose capture another call invalidated
    (seen on the H200 in CuPy 14.2's test_stream_capture_failure_cublas)."""
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    text = "the stream was capturing, but an error has invalidated the capture sequence"
    assert capture_error(RuntimeError(text)) == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
