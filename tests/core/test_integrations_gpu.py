"""The integrations on the real CuPy and cuda.core (GPU only; skip where not importable)."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capsafe import context, driver
from capsafe.backend import Backend
from capsafe.errors import CudaError
from capsafe.integrations import cuda_core as cuda_core_integration
from capsafe.integrations import cupy as cupy_integration
from capsafe_repro.window import NEIGHBOUR_THREAD, hold_open

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]
SUITE = Path(__file__).parents[2] / "repro" / "suites" / "cuda_core_capture"


@pytest.fixture
def gpu() -> Backend:
    drv = driver.get()
    if drv.name != "cuda":
        pytest.skip("the process-wide driver is not the cuda backend (CAPSAFE_BACKEND)")
    context.device(0)
    return drv


@contextlib.contextmanager
def neighbour(drv: Backend) -> Iterator[None]:
    """A thread calling cuCtxSynchronize through the facade; it breaks any capture beside it.
    Named as the harness names its neighbours, so `hold_open` keeps a window open until its
    calls met the capture (entered the gate, or wait at it), however loaded the machine."""
    stop = threading.Event()

    def run() -> None:
        context.device(0)
        while not stop.is_set():
            with contextlib.suppress(CudaError):
                drv.ctx_synchronize()

    thread = threading.Thread(target=run, name=f"{NEIGHBOUR_THREAD}0", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def cupy_capture(cupy: Any, x: Any) -> Any:
    """`x * 2 + 1` computed inside a CuPy capture (CuPy has no types: its objects are Any)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()  # RELAXED, CuPy's default
        try:
            hold_open()
            y = x * 2 + 1  # pool growth on the capturing thread, inside the window
        finally:
            graph = stream.end_capture()  # raises when the capture was invalidated
    graph.launch(stream)
    stream.synchronize()
    return y


def test_a_neighbour_breaks_a_bare_cupy_capture(gpu: Backend) -> None:
    cupy = pytest.importorskip("cupy")
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    cupy_capture(cupy, x)  # warm: kernels compiled, pool populated
    with neighbour(gpu), pytest.raises(cupy.cuda.runtime.CUDARuntimeError, match="Invalidated"):
        cupy_capture(cupy, x)


def test_an_installed_cupy_capture_survives_a_neighbour(gpu: Backend) -> None:
    cupy = pytest.importorskip("cupy")
    with cupy_integration.installed():
        pool = cupy.get_default_memory_pool()
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        assert pool.used_bytes() >= x.nbytes  # allocated from the gated pool
        with neighbour(gpu):
            for _ in range(3):
                y = cupy_capture(cupy, x)
        assert float(y[10]) == 21.0
        del x, y
        pool.free_all_blocks()


def test_cupy_capture_block_for_new_code(gpu: Backend) -> None:
    cupy = pytest.importorskip("cupy")
    x = cupy.ones(1 << 16, dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with neighbour(gpu), cupy_integration.capture(stream, "relaxed") as cap:
        hold_open()
        y = x + 1
    cap.graph.launch(stream)
    stream.synchronize()
    assert float(y.sum()) == 2.0 * x.size


def _suite_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "cuda_core_capture", SUITE / "test_graph_capture.py"
    )
    assert spec is not None and spec.loader is not None, SUITE
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_cuda_core_captures_survive_a_neighbour(gpu: Backend) -> None:
    pytest.importorskip("cuda.core")
    suite = _suite_module()
    with cuda_core_integration.installed(), neighbour(gpu):
        suite.test_three_captures()  # cuda.core's own begin/end_building, hooked


def test_a_neighbour_breaks_bare_cuda_core_captures(gpu: Backend) -> None:
    pytest.importorskip("cuda.core")
    suite = _suite_module()
    # Whichever call notices first: the end of the invalidated capture, or cuda.core's
    # graph memory resource refusing a stream that is no longer in an active capture
    # (seen on the H200, 2026-12-01).
    broken = r"INVALIDATED|invalidated|cannot perform memory operations on a non-capturing stream"
    with neighbour(gpu), pytest.raises(Exception, match=broken):
        suite.test_three_captures()
