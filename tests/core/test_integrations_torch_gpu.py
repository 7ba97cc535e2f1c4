"""torch.cuda.graph on a real GPU: a neighbour thread breaks captures in every mode, unless
capsafe.integrations.torch is installed; without neighbours the results are the same.

The neighbour is what capsafe's harness runs beside tests: a thread calling
cuCtxSynchronize through capsafe's gated facade. Run on a GPU with torch:
`python -m pytest -m cuda tests/core/test_integrations_torch_gpu.py`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from capsafe import context, driver
from capsafe.errors import CudaError
from capsafe.integrations import torch as integration

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
]
MODES = ["global", "thread_local", "relaxed"]
N = 1 << 20


@pytest.fixture
def torch() -> Iterator[Any]:
    torch = importlib.import_module("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    context.device(0)
    yield torch
    if integration.is_installed():
        integration.windows.release_all()
        integration.uninstall()


class Neighbour:
    """cuCtxSynchronize through capsafe's gated facade, in a loop, until the block ends."""

    def __init__(self) -> None:
        self.calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="neighbour", daemon=True)

    def _run(self) -> None:
        context.device(0)
        facade = driver.get()
        while not self._stop.is_set():
            with contextlib.suppress(CudaError):  # refused while an ungated capture is open
                facade.ctx_synchronize()
            self.calls += 1

    def __enter__(self) -> Neighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def run_beside(self, calls: int = 3, timeout: float = 30.0) -> None:
        """Return once the neighbour has made `calls` more calls (or fail the test)."""
        target, deadline = self.calls + calls, time.monotonic() + timeout
        while self.calls < target:
            assert time.monotonic() < deadline, "the neighbour made no calls"
            time.sleep(0.001)


def capture(torch: Any, mode: str, neighbour: Neighbour | None, protected: bool) -> Any:
    """out = x * 2 + 1 captured in `mode` (the neighbour running inside the window); replayed."""
    x = torch.arange(N, device="cuda", dtype=torch.float32)
    out = torch.zeros_like(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        out.copy_(x * 2 + 1)
        if neighbour is not None:
            if protected:
                time.sleep(0.05)  # the neighbour waits at the gate meanwhile
            else:
                neighbour.run_beside()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2 + 1)
    return out.cpu()


@pytest.mark.parametrize("mode", MODES)
def test_a_neighbour_breaks_an_unprotected_torch_capture(torch: Any, mode: str) -> None:
    with Neighbour() as neighbour, pytest.raises(RuntimeError):
        capture(torch, mode, neighbour, protected=False)


@pytest.mark.parametrize("mode", MODES)
def test_a_protected_torch_capture_survives_the_neighbour(torch: Any, mode: str) -> None:
    with integration.installed(), Neighbour() as neighbour:
        capture(torch, mode, neighbour, protected=True)
    assert neighbour.calls > 0  # it ran, before and after the window


def test_without_neighbours_results_are_the_same_protected_or_not(torch: Any) -> None:
    bare = [capture(torch, mode, None, protected=False) for mode in MODES]
    with integration.installed():
        protected = [capture(torch, mode, None, protected=True) for mode in MODES]
    assert all(torch.equal(a, b) for a, b in zip(bare, protected, strict=True))


def test_torchs_synchronize_waits_for_a_protected_capture_on_another_thread(torch: Any) -> None:
    """torch.cuda.synchronize() from another torch thread: unprotected it breaks the capture
    (cudaDeviceSynchronize); protected it waits for the window's end."""
    with integration.installed():
        x = torch.ones(N, device="cuda")
        out = torch.zeros_like(x)
        g = torch.cuda.CUDAGraph()
        done: list[object] = []
        with torch.cuda.graph(g, capture_error_mode="relaxed"):
            out.copy_(x + 1)
            thread = threading.Thread(target=lambda: done.append(torch.cuda.synchronize()))
            thread.start()
            time.sleep(0.05)
            assert done == []  # waiting at the gate
        thread.join(30)
        assert done == [None]
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x + 1)
