"""The gated driver facade and `capsafe.capture`: gating from the hazard table, deferral, errors."""

from __future__ import annotations

import functools
import gc
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from capsafe import driver, hazards
from capsafe.backend import Backend
from capsafe.capturing import Capture, capture
from capsafe.driver import GatedDriver
from capsafe.errors import CapsafeError, CaptureInvalidated, CudaError, UsageError
from capsafe.gate import CaptureGate
from capsafe.handles import LEGACY_STREAM, CaptureMode, Context
from capsafe.hazards.calls import METHOD_CALLS
from capsafe.sim import SimBackend

pytestmark = pytest.mark.timeout(300)
JOIN_S = 10.0
N = 4096


class _Thread(threading.Thread):
    """A thread that keeps what it raised, for `join` to raise again."""

    errors: list[BaseException]


def on_thread(backend: Backend, fn: Callable[[], object], name: str = "other") -> _Thread:
    """Run `fn` on a new thread with the backend's current context bound; errors kept."""
    context = backend.ctx_get_current()
    thread = _Thread(target=lambda: _bound(backend, context, fn, thread), name=name, daemon=True)
    thread.errors = []
    thread.start()
    return thread


def _bound(
    backend: Backend, context: Context | None, fn: Callable[[], object], thread: _Thread
) -> None:
    try:
        backend.ctx_set_current(context)
        fn()
    except BaseException as exc:
        thread.errors.append(exc)


def join(thread: _Thread) -> None:
    thread.join(JOIN_S)
    assert not thread.is_alive(), f"{thread.name} still blocked after {JOIN_S} s"
    if thread.errors:
        raise thread.errors[0]


@pytest.fixture
def gated(backend: Backend) -> Any:
    """A GatedDriver, used both as the Backend it stands for (driver.get() casts it so)
    and for its gate: Any, as neither type alone says both."""
    return GatedDriver(backend, CaptureGate())


def test_methods_the_table_flags_are_gated_and_the_rest_are_the_backends_own(
    sim_backend: SimBackend,
) -> None:
    facade = GatedDriver(sim_backend, CaptureGate())
    for method, call in METHOD_CALLS.items():
        own = getattr(sim_backend, method)
        if call in hazards.CAPTURE_BREAKING_CALLS:
            assert getattr(facade, method) != own, method
        elif method not in driver.DEFERRED_RELEASES:
            assert getattr(facade, method) == own, method


def test_stream_work_is_gated_only_on_the_legacy_stream(sim_backend: SimBackend) -> None:
    g = CaptureGate()
    facade = GatedDriver(sim_backend, g)
    ptr, stream = facade.mem_alloc(N), facade.stream_create()
    before = g.stats().shared_entered
    facade.memset_d8_async(ptr, 1, N, stream)
    assert g.stats().shared_entered == before
    facade.memset_d8_async(ptr, 1, N, LEGACY_STREAM)
    assert g.stats().shared_entered == before + 1
    facade.stream_synchronize(stream)  # may be the capturing stream: always gated
    assert g.stats().shared_entered == before + 2


def test_stream_work_named_by_keyword_is_classified_the_same(sim_backend: SimBackend) -> None:
    g = CaptureGate()
    facade = GatedDriver(sim_backend, g)
    ptr, stream = facade.mem_alloc(N), facade.stream_create()
    before = g.stats().shared_entered
    facade.memset_d8_async(ptr, 1, N, stream=stream)
    facade.mem_free_async(facade.mem_alloc_async(N, stream=stream), stream=stream)
    assert g.stats().shared_entered == before + 2  # async alloc/free on another stream
    facade.memset_d8_async(ptr, 1, N, stream=LEGACY_STREAM)
    assert g.stats().shared_entered == before + 3
    facade.stream_synchronize(stream)


def test_a_misspelled_capture_mode_is_a_one_line_usage_error(sim_backend: SimBackend) -> None:
    # A CapsafeError, so `capsafe ...` commands print it instead of a traceback.
    stream = sim_backend.stream_create()
    with pytest.raises(UsageError, match="unknown capture mode 'globl'; expected one of: global"):
        capture(stream, "globl", driver=sim_backend)
    assert issubclass(UsageError, CapsafeError) and issubclass(UsageError, ValueError)
    sim_backend.stream_destroy(stream)


def test_other_threads_allocation_waits_for_the_capture_instead_of_breaking_it(gated: Any) -> None:
    stream, buf = gated.stream_create(), gated.mem_alloc(N)
    allocated = threading.Event()
    with capture(stream, "global", driver=gated) as cap:
        gated.memset_d8_async(buf, 7, N, stream)

        def other_steps() -> None:
            gated.mem_free(gated.mem_alloc(N))
            allocated.set()

        other = on_thread(gated.backend, other_steps)
        other.join(0.1)
        assert not allocated.is_set(), "an allocation ran inside a GLOBAL capture window"
    join(other)
    assert allocated.is_set()
    gated.graph_exec_destroy(cap.instantiate())
    gated.graph_destroy(cap.graph)


def test_measured_policy_lets_an_allocation_run_beside_a_relaxed_capture(
    sim_backend: SimBackend,
) -> None:
    facade: Any = GatedDriver(sim_backend, CaptureGate(), policy="measured")
    stream = facade.stream_create()
    with capture(stream, CaptureMode.RELAXED, driver=facade):
        other = on_thread(sim_backend, lambda: facade.mem_free(facade.mem_alloc(N)))
        join(other)  # finished while the capture is still open
    assert facade.gate.stats().admitted_measured >= 1


class DeviceBuffer:
    """Owns device memory and frees it in a finalizer, like a tensor's storage."""

    def __init__(self, drv: Backend) -> None:
        self.drv, self.ptr = drv, drv.mem_alloc(N)

    def __del__(self) -> None:
        self.drv.mem_free(self.ptr)


def test_finalizer_freeing_memory_mid_capture_is_deferred_not_fatal(gated: Any) -> None:
    stream, buf = gated.stream_create(), gated.mem_alloc(N)
    doomed = DeviceBuffer(gated)
    ptr = doomed.ptr
    with capture(stream, "global", driver=gated) as cap:
        gated.memset_d8_async(buf, 1, N, stream)
        del doomed
        gc.collect()
        gated.memset_d8_async(buf, 2, N, stream)
    assert cap.graph is not None
    assert gated.gate.stats().deferred == 1
    with pytest.raises(CudaError):  # it was freed after the capture ended
        gated.mem_free(ptr)
    gated.graph_destroy(cap.graph)


def test_invalidated_capture_names_stream_mode_and_the_ungated_calls(
    sim_backend: SimBackend,
) -> None:
    ungated: Any = GatedDriver(sim_backend, None)
    stream = ungated.stream_create()
    with pytest.raises(CaptureInvalidated) as info, capture(stream, "global", driver=ungated):
        join(on_thread(sim_backend, lambda: _expect_cuda_error(ungated), "intruder"))
    message = str(info.value)
    assert f"stream {stream.value}" in message and "mode global" in message
    assert "ms" in message and "mem_alloc x1 on 'intruder'" in message


def _expect_cuda_error(drv: Backend) -> None:
    with pytest.raises(CudaError):
        drv.mem_alloc(N)


def test_capture_body_error_destroys_the_graph_and_propagates(sim_backend: SimBackend) -> None:
    facade: Any = GatedDriver(sim_backend, CaptureGate())
    stream = facade.stream_create()
    cap = Capture(stream, "thread_local", facade)
    with pytest.raises(KeyError), cap:
        raise KeyError("body")
    assert cap.graph is None
    assert facade.gate.stats().open_captures == 0


def test_get_returns_the_gated_facade_and_raw_the_backend() -> None:
    facade = driver.get()
    assert isinstance(facade, GatedDriver) and isinstance(facade, Backend)
    assert facade.gated and facade.backend is driver.raw()
    assert cast(GatedDriver, driver.get(gated=False)).gate is None


def test_capsafe_gate_0_turns_gating_off() -> None:
    env = {**os.environ, "CAPSAFE_GATE": "0", "CAPSAFE_BACKEND": "sim", "CAPSAFE_FROZEN_GUARD": "0"}
    code = "from capsafe import driver; d = driver.get(); print(d.gated, d.name)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert out.stdout.split() == ["False", "sim"]


def test_stress_threads_mixing_gated_calls_and_captures_never_break_a_capture(gated: Any) -> None:
    """8 threads, random mixes of capture-breaking calls and captures, for ~1.5 s."""
    stop_at = time.monotonic() + 1.5
    failures: list[BaseException] = []
    counts = [0] * 8

    def worker(index: int) -> None:
        rng = random.Random(index)
        stream, buf = gated.stream_create(), gated.mem_alloc(N)
        try:
            # At least 20 steps each, however late a loaded machine starts the thread.
            while time.monotonic() < stop_at or counts[index] < 20:
                step = rng.random()
                if step < 0.3:
                    mode = rng.choice(("global", "thread_local"))
                    with capture(stream, mode, driver=gated) as cap:
                        gated.memset_d8_async(buf, index, N, stream)
                    gated.graph_destroy(cap.graph)
                elif step < 0.6:
                    gated.mem_free(gated.mem_alloc(N))
                elif step < 0.8:
                    gated.memset_d8(buf, 0, N)
                else:
                    gated.stream_synchronize(stream)
                counts[index] += 1
        except BaseException as exc:
            failures.append(exc)
        finally:
            gated.mem_free(buf)
            gated.stream_destroy(stream)

    threads = [
        on_thread(gated.backend, functools.partial(worker, i), f"stress-{i}") for i in range(8)
    ]
    for thread in threads:
        join(thread)
    assert not failures, failures[0]
    assert all(counts), counts
    assert gated.gate.stats().open_captures == 0
