"""The one table of hazard actions: its invariants, and that each action makes its row's call."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.errors import CudaError
from capsafe.handles import Stream
from capsafe.hazards.actions import (
    ACTIONS,
    BREAKING,
    BY_NAME,
    PREPARED_BY_CAPTURE,
    ActionKit,
    HazardAction,
)
from capsafe.hazards.calls import hazard_call
from capsafe.sim import SimBackend


class Recording:
    """A backend proxy that records (method, stream argument) while `recording` is set."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.recording = False
        self.calls: list[tuple[str, Stream | None]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.recording:
                stream = kwargs.get("stream")
                streams = [a for a in args if isinstance(a, Stream)]
                self.calls.append((name, stream or (streams[-1] if streams else None)))
            return attr(*args, **kwargs)

        return call


@pytest.fixture
def kit(sim_backend: SimBackend) -> Any:
    recording = Recording(sim_backend)
    device = sim_backend.device_get(0)
    sim_backend.primary_ctx_retain(device)  # primary_ctx_release_retain must not reach zero
    capturing = sim_backend.stream_create(nonblocking=True)
    made = ActionKit(recording, capturing=capturing)  # type: ignore[arg-type]
    yield made, recording
    made.close()
    sim_backend.stream_destroy(capturing)
    sim_backend.primary_ctx_release(device)


def test_one_action_per_table_row_in_table_order() -> None:
    assert [a.row for a in ACTIONS] == list(hazards.CALLS)


def test_names_are_unique_short_and_stable() -> None:
    assert len(BY_NAME) == len(ACTIONS)
    for action in ACTIONS:
        assert re.fullmatch(r"[a-z][a-z0-9_]{2,31}", action.name), action.name


def test_methods_are_backend_methods() -> None:
    for action in ACTIONS:
        assert set(action.methods) <= Backend.__abstractmethods__, action.name


def test_breaking_is_exactly_the_capture_breaking_rows() -> None:
    # Less the rows whose preparation is a capture of its own (measured by the trial only).
    expected = hazards.CAPTURE_BREAKING_CALLS - PREPARED_BY_CAPTURE
    assert {a.row for a in BREAKING} == expected
    assert PREPARED_BY_CAPTURE <= hazards.CAPTURE_BREAKING_CALLS
    assert all(a.breaks_captures for a in BREAKING)


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a.name)
def test_perform_calls_exactly_its_methods_and_the_facade_names_its_row(
    kit: tuple[ActionKit, Recording], action: HazardAction
) -> None:
    made, recording = kit
    prepared = action.prepare(made) if action.prepare is not None else None
    recording.recording = True
    leftover = action.perform(made, prepared)
    recording.recording = False
    if leftover is not None:
        made.leftovers.append(leftover)
    made.retry_leftovers()
    assert [m for m, _ in recording.calls] == list(action.methods)
    # The facade's own classification of these calls (what the gate and the sim use)
    # names this row: the table and the gate cannot disagree about what an action is.
    rows = {hazard_call(m, s, made.capturing) for m, s in recording.calls}
    if action.row == "noop":
        assert rows == set()
    elif action.row not in rows:  # a compound row (alloc + free): its parts break alike
        assert rows and all(
            r is not None and hazards.ever_breaks(r) == action.breaks_captures for r in rows
        ), rows


def test_a_failed_call_keeps_its_prepared_resource_for_a_retry(
    kit: tuple[ActionKit, Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    made, recording = kit
    real_free: Callable[..., Any] = recording._backend.mem_free
    failures = iter([CudaError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "cuMemFree")])

    def flaky_free(ptr: Any) -> None:
        for exc in failures:
            raise exc
        real_free(ptr)

    monkeypatch.setattr(recording._backend, "mem_free", flaky_free)
    with pytest.raises(CudaError):
        made.run(BY_NAME["mem_free"])
    assert len(made.leftovers) == 1
    made.retry_leftovers()
    assert made.leftovers == []


def test_stream_query_capturing_needs_the_capturing_stream(sim_backend: SimBackend) -> None:
    action = BY_NAME["stream_query_capturing"]
    assert action.needs_capturing
    assert [a.name for a in ACTIONS if a.needs_capturing] == ["stream_query_capturing"]
    made = ActionKit(sim_backend)
    try:
        with pytest.raises(ValueError, match="capturing stream"):
            made.run(action)
    finally:
        made.close()
