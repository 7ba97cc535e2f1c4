"""capsafe.integrations.cuda_core against a small fake of cuda.core, on the sim backend.

The fake (repro/suites/cuda_core_capture/fake_cuda_core.py, injected as
`cuda.core` and `cuda.core.graph`) has what the integration touches:
`Device.memory_resource` (a property, default: a stream-ordered resource over
the sim driver's cuMemAllocAsync/cuMemFreeAsync), `Buffer.from_handle`/`close`,
`MemoryResource`, and a `GraphBuilder` whose begin/end_building call the raw
sim driver as cuda.core calls the driver.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from test_integrations_cupy import Neighbour

from capsafe.driver import GatedDriver
from capsafe.errors import CaptureInvalidated, UsageError
from capsafe.gate import CaptureGate
from capsafe.integrations import cuda_core as integration
from capsafe.sim import SimBackend

pytestmark = pytest.mark.timeout(60)
KiB = 1 << 10


FAKE = Path(__file__).parents[2] / "repro" / "suites" / "cuda_core_capture" / "fake_cuda_core.py"


def fake_cuda_core(sim: SimBackend) -> tuple[Any, Any]:
    """The fake the cuda_core_capture planted suite runs on without a GPU (one fake, two users)."""
    spec = importlib.util.spec_from_file_location("fake_cuda_core", FAKE)
    assert spec is not None and spec.loader is not None, FAKE
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fakes: tuple[Any, Any] = module.fake_cuda_core(sim)  # (cuda.core, cuda.core.graph)
    return fakes


@pytest.fixture
def core(sim_backend: SimBackend, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    fake, graph = fake_cuda_core(sim_backend)
    monkeypatch.setitem(sys.modules, "cuda.core", fake)
    monkeypatch.setitem(sys.modules, "cuda.core.graph", graph)
    yield fake
    if integration.is_installed():
        integration.windows.release_all()
        integration.uninstall()


@pytest.fixture
def facade(sim_backend: SimBackend) -> Any:
    """A GatedDriver, used both as the Backend it stands for (driver.get() casts it so)
    and for its gate: Any, as neither type alone says both."""
    return GatedDriver(sim_backend, CaptureGate())


def used(sim: SimBackend) -> int:
    free, total = sim.mem_get_info()
    return total - free


def builder_cls() -> Any:
    return sys.modules["cuda.core.graph"].GraphBuilder


def test_install_is_idempotent_and_uninstall_restores_everything(core: Any, facade: Any) -> None:
    prop = core.Device.__dict__["memory_resource"]
    methods = {n: builder_cls().__dict__[n] for n in ("begin_building", "end_building", "close")}
    assert integration.install(facade) is True
    assert integration.install(facade) is False
    assert core.Device.__dict__["memory_resource"] is not prop
    assert builder_cls().__dict__["begin_building"] is not methods["begin_building"]
    assert integration.uninstall() is True
    assert integration.uninstall() is False
    assert core.Device.__dict__["memory_resource"] is prop
    assert {n: builder_cls().__dict__[n] for n in methods} == methods


def test_the_devices_resource_is_seen_gated(
    core: Any, facade: Any, sim_backend: SimBackend
) -> None:
    integration.install(facade)
    device = core.Device()
    resource = device.memory_resource
    assert isinstance(resource, integration._resource_class())
    assert device.memory_resource is resource  # one view per inner resource
    entered, before = facade.gate.stats().shared_entered, used(sim_backend)
    stream = device.create_stream()
    buffer = device.allocate(4 * KiB, stream=stream)
    assert buffer.mr is resource and used(sim_backend) == before + 4 * KiB
    buffer.close()
    sim_backend.stream_synchronize(stream.raw)  # the free is stream-ordered
    assert used(sim_backend) == before
    assert facade.gate.stats().shared_entered == entered + 2  # allocation and free, gated
    with pytest.raises(UsageError, match="not allocated by this resource"):
        resource.deallocate(buffer.ptr or 0x1234, 16)


def test_a_free_on_the_capturing_thread_waits_for_the_window_unless_made_inside_it(
    core: Any, facade: Any, sim_backend: SimBackend
) -> None:
    integration.install(facade)
    device = core.Device()
    stream = device.create_stream()
    outside = device.allocate(4 * KiB, stream=stream)
    held = used(sim_backend)
    builder = device.create_graph_builder().begin_building("global")
    outside.close()  # cuMemFreeAsync on another stream inside a GLOBAL window would break it
    assert used(sim_backend) == held and facade.gate.stats().deferred == 1
    inside = device.allocate(KiB, stream=builder)  # captured: a graph allocation
    inside.close(builder)  # captured with it, not deferred
    assert facade.gate.stats().deferred == 1
    during = used(sim_backend)
    builder.end_building()
    sim_backend.stream_synchronize(stream.raw)
    assert used(sim_backend) == during - 4 * KiB  # the deferred free ran after the window


def test_end_building_that_raises_gives_the_gate_back(core: Any, facade: Any) -> None:
    integration.install(facade)
    builder = core.Device().create_graph_builder().begin_building()
    assert facade.gate.stats().open_captures == 1
    builder.end_error = RuntimeError("invalidated")
    with pytest.raises(RuntimeError, match="invalidated"):
        builder.end_building()
    assert facade.gate.stats().open_captures == 0


def three_captures(
    device: Any,
    capture: Callable[[Any], AbstractContextManager[object]],
    during: Callable[[], object],
) -> None:
    """Three windows, each with an allocation made before it and one inside it."""
    stream = device.create_stream()
    for _ in range(3):
        before = device.allocate(KiB, stream=stream)
        builder = device.create_graph_builder()
        with capture(builder):
            inside = device.allocate(KiB, stream=builder)
            during()
            inside.close(builder)
        before.close()


@contextlib.contextmanager
def _raw(builder: Any) -> Iterator[None]:
    builder.begin_building()
    yield
    builder.end_building()


@pytest.mark.parametrize("how", ["bare", "installed", "capture-helper"])
def test_three_captures_beside_a_neighbour(
    core: Any, facade: Any, sim_backend: SimBackend, how: str
) -> None:
    if how == "installed":
        integration.install(facade)
    capture: Callable[[Any], AbstractContextManager[object]] = (
        (lambda b: integration.capture(b, driver=facade)) if how == "capture-helper" else _raw
    )
    with Neighbour(facade, sim_backend) as neighbour:
        if how == "bare":
            with pytest.raises(CaptureInvalidated):
                three_captures(core.Device(), capture, neighbour.run_beside)
        else:
            three_captures(core.Device(), capture, lambda: time.sleep(0.02))
    integration.windows.release_all()
    assert facade.gate.stats().open_captures == 0


def test_uninstall_is_refused_while_a_builder_is_building(core: Any, facade: Any) -> None:
    integration.install(facade)
    builder = core.Device().create_graph_builder().begin_building()
    with pytest.raises(UsageError, match="still building"):
        integration.uninstall()
    builder.close()  # close ends the capture too, and gives the gate back
    assert facade.gate.stats().open_captures == 0
    assert integration.uninstall()


def test_install_patches_the_real_cuda_core_types_and_restores_them(
    sim_backend: SimBackend,
) -> None:
    real = pytest.importorskip("cuda.core.graph")
    core = pytest.importorskip("cuda.core")
    builder_cls = real.GraphBuilder
    saved = {n: builder_cls.__dict__[n] for n in ("begin_building", "end_building", "close")}
    prop = core.Device.__dict__["memory_resource"]
    facade: Any = GatedDriver(sim_backend, CaptureGate())  # a Backend with a gate
    with integration.installed(facade):
        assert builder_cls.__dict__["begin_building"] is not saved["begin_building"]
        assert core.Device.__dict__["memory_resource"] is not prop
        builder = builder_cls.__new__(builder_cls)  # no stream: cuda.core's own begin fails
        with pytest.raises(Exception):  # noqa: B017 - whatever cuda.core raises without a GPU
            builder.begin_building("global")
        assert facade.gate.stats().open_captures == 0  # the gate went back when it raised
        assert facade.gate.stats().captures == 1
    assert {n: builder_cls.__dict__[n] for n in saved} == saved
    assert core.Device.__dict__["memory_resource"] is prop


def test_a_buffer_allocated_in_one_window_and_freed_in_the_next_is_deferred(
    core: Any, facade: Any
) -> None:
    integration.install(facade)
    device = core.Device()
    first = device.create_graph_builder().begin_building("relaxed")
    # On another stream, inside window 1:
    buffer = device.allocate(KiB, stream=device.create_stream())
    first.end_building()
    second = device.create_graph_builder().begin_building("global")
    buffer.close()  # not captured by window 2: it must wait for the window's end
    assert facade.gate.stats().deferred == 1
    second.end_building()  # no CaptureInvalidated: the free ran after the GLOBAL window
