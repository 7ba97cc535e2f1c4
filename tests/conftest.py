"""Fixtures for device tests: a fresh driver per test, with a context bound on this thread.

Contract (other test modules rely on these names):
- `sim_backend`: a new `SimBackend`, initialized, device 0's primary context
  retained and current on the calling thread; released at teardown, which makes the
  thread's previous context current again.
- `backend`: the same setup, parametrized over "sim" and "cuda"; the "cuda"
  case carries the `cuda` marker, so it skips with a reason on machines without a GPU.
- `sim_kernel`: `sim_kernel(name, fn)` registers a kernel stand-in for this test only.
- `sim_process_driver`: the process-wide driver (what neighbour threads and
  `capsafe.device()` use) with device 0 bound; skips unless it is the simulated one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import TypeVar

import pytest

from capsafe import context, driver
from capsafe.backend import Backend
from capsafe.sim import KernelStandIn, SimBackend, kernel_standin

B = TypeVar("B", bound=Backend)


def _bound(backend: B) -> Iterator[B]:
    """Init, retain device 0's primary context and bind it; undo both afterwards.

    The thread's current context is the driver's, shared with everything else in
    the process (capsafe.device() among them), so teardown puts back what it found.
    """
    backend.init()
    device = backend.device_get(0)
    previous = backend.ctx_get_current()
    context = backend.primary_ctx_retain(device)
    backend.ctx_set_current(context)
    try:
        yield backend
    finally:
        backend.ctx_set_current(previous)
        backend.primary_ctx_release(device)


def _make_backend(name: str) -> Backend:
    if name == "sim":
        return SimBackend()
    from capsafe.backend_cuda import CudaBackend

    return CudaBackend()


@pytest.fixture
def sim_backend() -> Iterator[SimBackend]:
    yield from _bound(SimBackend())


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    yield from _bound(_make_backend(request.param))


@pytest.fixture
def sim_kernel() -> Iterator[Callable[[str, KernelStandIn], KernelStandIn]]:
    """Register kernel stand-ins that are removed (and any previous one restored) at teardown."""
    with ExitStack() as stack:

        def register(name: str, fn: KernelStandIn) -> KernelStandIn:
            return stack.enter_context(kernel_standin(name, fn))

        yield register


@pytest.fixture
def sim_process_driver() -> Backend:
    if driver.get().name != "sim":
        pytest.skip("drives the process-wide driver; needs it to be the simulated one")
    context.device(0)
    return driver.get()
