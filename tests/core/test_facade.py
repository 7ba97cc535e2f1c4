"""The driver facade is default-closed (issue 12, problem 7) and holds the gate while a
capture is really open (problem 5)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.driver import (
    DEFERRED_RELEASES,
    NO_ROW_GATED,
    NO_ROW_UNGATED,
    GatedDriver,
    Gating,
    classify,
)
from capsafe.errors import CudaError
from capsafe.gate import CaptureGate
from capsafe.handles import CaptureMode, CaptureStatus
from capsafe.hazards.calls import METHOD_CALLS
from capsafe.sim import SimBackend

pytestmark = pytest.mark.timeout(60)
METHODS = sorted(Backend.__abstractmethods__)


@pytest.mark.parametrize("method", METHODS)
def test_every_backend_method_is_classified_with_evidence(method: str) -> None:
    how = classify(method)
    assert not how.evidence.startswith("unclassified"), f"classify Backend.{method} in driver.py"
    if how.gating is Gating.UNGATED and how.call is not None:
        assert not hazards.ever_breaks(how.call)  # the row's evidence: it breaks no cell
    if how.gating is Gating.GATED and how.call is not None:
        assert how.call in hazards.CAPTURE_BREAKING_CALLS


def test_the_no_row_tables_name_only_methods_without_a_row() -> None:
    assert not (NO_ROW_UNGATED.keys() | NO_ROW_GATED.keys()) & METHOD_CALLS.keys()
    assert not NO_ROW_UNGATED.keys() & NO_ROW_GATED.keys()
    assert (NO_ROW_UNGATED.keys() | NO_ROW_GATED.keys()) <= set(METHODS)


def test_an_unclassified_method_is_gated_not_bound_raw() -> None:
    how = classify("some_new_driver_call")
    assert how.gating is Gating.GATED and how.call is None


def test_only_never_capture_breaking_methods_are_the_backends_own(
    sim_backend: SimBackend,
) -> None:
    facade = GatedDriver(sim_backend, CaptureGate())
    for method in METHODS:
        own = getattr(facade, method) == getattr(sim_backend, method)
        raw = classify(method).gating is Gating.UNGATED and method not in DEFERRED_RELEASES
        assert own == raw, method


def test_getattr_passes_nothing_through(sim_backend: SimBackend) -> None:
    facade = GatedDriver(sim_backend, CaptureGate())
    extras = [n for n in dir(sim_backend) if not n.startswith("__") and n not in METHODS]
    assert extras, "the sim has backend-specific attributes to try"
    for name in extras:
        if name == "name":
            continue
        with pytest.raises(AttributeError, match=r"capsafe\.backend\.Backend"):
            getattr(facade, name)


def test_an_unnamed_gated_method_waits_for_a_capture(sim_backend: SimBackend) -> None:
    gate = CaptureGate()
    facade = GatedDriver(sim_backend, gate)
    event = facade.event_create()
    guard = gate.begin_capture(timeout=5)
    done = threading.Event()
    context = sim_backend.ctx_get_current()

    def query() -> None:
        sim_backend.ctx_set_current(context)
        facade.event_query(event)
        done.set()

    thread = threading.Thread(target=query, daemon=True)
    thread.start()
    assert not done.wait(0.2)  # event_query is unmeasured: it waits
    guard.release()
    assert done.wait(5)
    facade.event_destroy(event)


def test_the_facade_does_not_import_the_trial_rig() -> None:
    code = (
        "import sys, capsafe.driver; "
        "bad = [m for m in ('capsafe.hazards.trial', 'capsafe.hazards.actions') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_refused_end_capture_keeps_the_gate(sim_backend: SimBackend) -> None:
    gate = CaptureGate()
    facade = GatedDriver(sim_backend, gate)
    context = sim_backend.ctx_get_current()
    stream = facade.stream_create(nonblocking=True)
    facade.stream_begin_capture(stream, CaptureMode.GLOBAL)
    errors: list[CudaError] = []

    def end_elsewhere() -> None:
        sim_backend.ctx_set_current(context)
        try:
            facade.stream_end_capture(stream)
        except CudaError as exc:
            errors.append(exc)

    thread = threading.Thread(target=end_elsewhere, daemon=True)
    thread.start()
    thread.join(5)
    assert errors and errors[0].result == "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"
    assert sim_backend.stream_is_capturing(stream) is CaptureStatus.ACTIVE
    allocated: list[object] = []

    def allocate() -> None:
        sim_backend.ctx_set_current(context)
        allocated.append(facade.mem_alloc(256))

    allocator = threading.Thread(target=allocate, daemon=True)
    allocator.start()
    allocator.join(0.2)
    assert allocator.is_alive(), "the allocation ran beside the still-open GLOBAL capture"
    facade.graph_destroy(facade.stream_end_capture(stream))  # ends; the gate opens
    allocator.join(5)
    assert allocated
    facade.mem_free(allocated[0])
    facade.stream_destroy(stream)
