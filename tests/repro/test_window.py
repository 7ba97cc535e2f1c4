"""The planted capture suites' window (capsafe_repro.window): it spans the neighbours' calls
however slowly they come, and costs nothing where no neighbour runs."""

from __future__ import annotations

import time

import pytest

import capsafe
from capsafe.backend import Backend
from capsafe.gate import gate
from capsafe.handles import CaptureMode, CaptureStatus
from capsafe_harness.plugin import neighbors as nb
from capsafe_repro import window

SLOW = 0.01  # s between a neighbour's calls: a fixed 50 ms window saw about 5 of them


def calls(status: nb.NeighborStatus) -> int:
    return sum(status.steps.values()) + sum(status.driver_errors.values())


def started(count: int, calls_: list[str]) -> nb.Neighbors:
    """Neighbours that have set up (as the plugin's have before any test): one that sets up
    inside a capture cannot, and ends."""
    neighbours = nb.Neighbors(count, calls_, interval=SLOW)
    neighbours.start()
    while calls(neighbours.status) < count:  # the test's timeout is the watchdog
        time.sleep(0.01)
    return neighbours


def test_without_neighbours_it_returns_at_once(
    sim_process_driver: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_poll(seconds: float) -> None:
        raise AssertionError("waited with no neighbour running")

    monkeypatch.setattr("capsafe_repro.window.time.sleep", no_poll)
    assert window.neighbours() == []
    window.hold_open()


@pytest.mark.timeout(120)  # a hang watchdog: normally 1 s
def test_an_ungated_window_spans_the_neighbours_calls_however_slow(
    sim_process_driver: Backend,
) -> None:
    drv = sim_process_driver
    stream = drv.stream_create(nonblocking=True)
    neighbours = started(1, ["ctx_sync"])
    try:
        assert len(window.neighbours()) == 1  # the harness's thread names, as the window reads them
        raw = capsafe.driver.get(gated=False)
        raw.stream_begin_capture(stream, CaptureMode.GLOBAL)
        window.hold_open()
        made = calls(neighbours.status)
        status = raw.stream_is_capturing(stream)
        with pytest.raises(capsafe.errors.CaptureInvalidated):
            raw.stream_end_capture(stream)
    finally:
        neighbours.stop()
        drv.stream_destroy(stream)
    assert made >= window.CALLS - 1  # all but the one in flight finished inside the window
    assert status is CaptureStatus.INVALIDATED


@pytest.mark.timeout(120)  # a hang watchdog
def test_a_gated_window_ends_once_every_neighbour_is_parked(sim_process_driver: Backend) -> None:
    # Both parked before the window opened (their waits counted already): it still ends.
    drv = sim_process_driver
    stream = drv.stream_create(nonblocking=True)
    neighbours = started(2, ["ctx_sync"])
    try:
        waits = gate().stats().contended_waits
        with capsafe.capture(stream, CaptureMode.GLOBAL) as cap:
            while gate().stats().contended_waits < waits + 2:  # the timeout is the watchdog
                time.sleep(0.001)
            window.hold_open()
            made = calls(neighbours.status)
            window.hold_open()
            assert calls(neighbours.status) == made  # held back all along
        assert cap.graph is not None
        drv.graph_destroy(cap.graph)
    finally:
        status = neighbours.stop()
        drv.stream_destroy(stream)
    assert not status.driver_errors and not status.problems
