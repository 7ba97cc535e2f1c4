"""Neighbour threads: the call kinds they make, their own errors per kind, and bounded stops."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from capsafe import context, driver, hazards
from capsafe.backend import Backend
from capsafe.errors import BackendUnavailable, CaptureInvalidated
from capsafe.gate import gate
from capsafe.handles import CaptureMode
from capsafe.hazards.actions import BY_NAME, PREPARED_BY_CAPTURE
from capsafe_harness.plugin import neighbors as nb
from capsafe_harness.records import Record, Signal, read_records

pytest_plugins = ["pytester"]


def test_kinds_cover_every_capture_breaking_row_they_can() -> None:
    rows = {BY_NAME[n].row for n in nb.issued_calls()}
    skipped = {BY_NAME[n].row for n in nb.NOT_ISSUED} | PREPARED_BY_CAPTURE  # never looped
    assert rows | skipped == hazards.CAPTURE_BREAKING_CALLS and not rows & skipped


def test_parse_calls_names_the_known_kinds() -> None:
    assert nb.parse_calls(" ctx_sync,mem_alloc,ctx_sync ") == ("ctx_sync", "mem_alloc")
    with pytest.raises(
        ValueError, match=r"unknown call kind.*mem_aloc.*neighbours make: mem_alloc"
    ):
        nb.parse_calls("mem_aloc")
    with pytest.raises(ValueError, match="no call kind given"):
        nb.parse_calls(" , ")


def test_restricted_neighbours_make_only_their_kinds(sim_process_driver: Backend) -> None:
    n = nb.Neighbors(2, ["ctx_sync"])
    n.start()
    while not n.status.steps:  # a fixed sleep can end before a loaded machine ran one
        time.sleep(0.01)  # the test's timeout is the watchdog
    status = n.stop()
    assert set(status.steps) == {"ctx_sync"} and status.steps["ctx_sync"] > 0
    assert not status.problems and status.backend == "sim"


def test_own_driver_errors_are_counted_per_kind(sim_process_driver: Backend) -> None:
    raw = driver.get(gated=False)
    stream = raw.stream_create(nonblocking=True)
    n = nb.Neighbors(1, ["mem_alloc", "memset_sync"])
    n.start()
    try:
        while not n.status.steps:  # set up before the capture: one set up inside it cannot
            time.sleep(0.01)  # the test's timeout is the watchdog
        raw.stream_begin_capture(stream, CaptureMode.GLOBAL)
        deadline = time.monotonic() + 60  # a hang watchdog: they fail at once
        while not n.status.driver_errors and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(CaptureInvalidated):
            raw.stream_end_capture(stream)
    finally:
        status = n.stop()
        raw.stream_destroy(stream)
    # GLOBAL refuses another thread's cuMemAlloc; a nonblocking capture lets memsets by.
    assert status.driver_errors["mem_alloc"] > 0 and "memset_sync" not in status.driver_errors


@pytest.mark.timeout(30)
def test_a_stuck_neighbour_is_reported_and_stop_returns(sim_process_driver: Backend) -> None:
    gated = driver.get()
    stream = gated.stream_create(nonblocking=True)
    gated.stream_begin_capture(stream, CaptureMode.GLOBAL)  # holds the gate: neighbours wait
    n = nb.Neighbors(2, ["mem_alloc"])
    waits = gate().stats().contended_waits
    try:
        n.start()
        while gate().stats().contended_waits < waits + 2:  # both wait at the gate (a sleep
            time.sleep(0.01)  # is not enough on a loaded machine: one could stop before it)
        status = n.stop(timeout=0.3)  # an unbounded stop: the watchdog (30 s) fails it
        assert len(status.problems) == 2 and all("did not stop" in p for p in status.problems)
    finally:
        gated.graph_destroy(gated.stream_end_capture(stream))
        gated.stream_destroy(stream)


def test_unavailable_neighbours_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(ordinal: int = 0) -> None:
        raise BackendUnavailable("CAPSAFE_BACKEND=cuda but no NVIDIA driver")

    monkeypatch.setattr(context, "device", refuse)
    n = nb.Neighbors(2)
    with pytest.raises(nb.NeighborsUnavailable, match="no NVIDIA driver"):
        n.start()
    assert "BackendUnavailable" in n.status.unavailable and not n._threads


def test_status_files_round_trip(tmp_path: Path) -> None:
    status = nb.NeighborStatus(2, ("ctx_sync",), backend="sim")
    status.driver_errors["ctx_sync"] += 3
    nb.write_status(nb.status_path(tmp_path, "run-1", "gw0"), status)
    (tmp_path / "neighbors-broken.json").write_text("{")
    (read,) = nb.read_statuses([tmp_path])
    assert read["driver_errors"] == {"ctx_sync": 3} and read["calls"] == ["ctx_sync"]


SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"
RunSuite = Callable[..., tuple[pytest.RunResult, dict[str, Record], list[dict[str, Any]]]]
"""(the run, its call rows by node id, the neighbour status files) for the given options."""


@pytest.fixture
def run_capture_suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> RunSuite:
    """The planted capture suite in a subprocess with only this plugin loaded; returns
    (result, rows by node id, the one neighbour status file)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    suite = SUITES / "capture"

    def run(*args: str) -> tuple[pytest.RunResult, dict[str, Record], list[dict[str, Any]]]:
        result = pytester.runpytest_subprocess(
            "-p", "capsafe_harness.plugin", str(suite), "--rootdir", str(suite),
            f"--capsafe-records={tmp_path}", "--capsafe-neighbors=2", *args,
        )  # fmt: skip
        rows = {r["nodeid"]: r for r in read_records(tmp_path) if r["phase"] == "call"}
        return result, rows, nb.read_statuses([tmp_path])

    return run


def test_neighbours_limited_to_a_kind_the_capture_survives(run_capture_suite: RunSuite) -> None:
    # A GLOBAL capture on a nonblocking stream lets other threads' synchronous memsets by.
    result, _, (status,) = run_capture_suite("--capsafe-neighbor-calls=memset_sync")
    result.assert_outcomes(passed=2)
    assert set(status["steps"]) == {"memset_sync"}


def test_neighbours_limited_to_a_breaking_kind(run_capture_suite: RunSuite) -> None:
    result, rows, (status,) = run_capture_suite("--capsafe-neighbor-calls=ctx_sync")
    result.assert_outcomes(passed=1, failed=1)
    raw = rows["test_capture.py::test_raw_global_capture"]
    assert raw["signals"] == [Signal.CAPTURE_INVALIDATED, Signal.FAILED_IN_CAPTURE]
    assert set(status["steps"]) | set(status["driver_errors"]) == {"ctx_sync"}


def test_unknown_kind_is_a_usage_error(run_capture_suite: RunSuite) -> None:
    result, _, _ = run_capture_suite("--capsafe-neighbor-calls=ctx_synch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "unknown call kind(s) ctx_synch" in result.stderr.str()


def test_neighbours_that_cannot_start_fail_every_test(
    run_capture_suite: RunSuite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAPSAFE_BACKEND", "no-such-backend")
    result, _, (status,) = run_capture_suite()
    result.assert_outcomes(errors=2)
    assert "neighbour threads could not start" in result.stdout.str()
    assert "no-such-backend" in status["unavailable"]


@pytest.mark.slow
def test_neighbours_stuck_behind_a_capture_never_hang_the_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The test opens a gated capture and never ends it: the neighbours wait at the gate for
    # good. The session still ends, says which threads did not stop, and the process exits.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("CAPSAFE_BACKEND", "sim")
    pytester.makepyfile(
        test_stuck="""
        import time
        import capsafe
        from capsafe import driver
        from capsafe.handles import CaptureMode

        def test_leaves_a_capture_open():
            capsafe.device(0)
            drv = driver.get()
            drv.stream_begin_capture(drv.stream_create(nonblocking=True), CaptureMode.GLOBAL)
            time.sleep(0.2)
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "capsafe_harness.plugin", f"--capsafe-records={tmp_path}", "--capsafe-neighbors=2",
        "--capsafe-neighbor-calls=mem_alloc", timeout=280,
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "capsafe-neighbor-0 did not stop within 5 s" in out
    (status,) = nb.read_statuses([tmp_path])
    assert len(status["problems"]) == 2
