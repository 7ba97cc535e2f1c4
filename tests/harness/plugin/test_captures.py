"""The plugin records where each test's captures are, and which failures were raised inside one."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsafe_harness.records import Signal, read_records

pytest_plugins = ["pytester"]

SUITE = """
import capsafe
from capsafe import driver
from capsafe.handles import CaptureMode


def _stream():
    capsafe.device(0)
    drv = driver.get(gated=False)
    return drv, drv.stream_create(nonblocking=True)


def test_left_open():
    drv, stream = _stream()
    drv.stream_begin_capture(stream, CaptureMode.GLOBAL)  # left-open
    raise RuntimeError("a library status, not a capture error")


def test_ended_then_failed():
    drv, stream = _stream()
    drv.stream_begin_capture(stream, CaptureMode.RELAXED)  # ended
    drv.graph_destroy(drv.stream_end_capture(stream))
    assert 1 == 2


def test_body_raises_in_capture():
    drv, stream = _stream()
    with capsafe.capture(stream, mode="thread_local", driver=drv):  # in-with
        raise KeyError("raised in the window")


def test_no_capture():
    assert 1 == 2
"""


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(SUITE.splitlines()) if text.endswith(marker))


@pytest.mark.timeout(120)
def test_rows_carry_captures_and_failures_inside_them(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAPSAFE_BACKEND", "sim")
    pytester.makepyfile(test_suite=SUITE)
    out = tmp_path / "records"
    result = pytester.runpytest_subprocess("-p", "no:randomly", f"--capsafe-records={out}")
    result.assert_outcomes(failed=4)
    rows = {(r["nodeid"].split("::")[1], r["phase"]): r for r in read_records(out)}

    def captures(test: str) -> list[tuple[str, str, bool]]:
        found = rows[(test, "teardown")].get("captures", [])
        return [(c["mode"], c["site"], c["open"]) for c in found]

    def inside(test: str) -> bool:
        return Signal.FAILED_IN_CAPTURE in rows[(test, "call")]["signals"]

    assert captures("test_left_open") == [("global", f"test_suite.py:{_line('# left-open')}", True)]
    assert inside("test_left_open")  # the failure reached pytest with its window open
    assert captures("test_ended_then_failed") == [
        ("relaxed", f"test_suite.py:{_line('# ended')}", False)
    ]
    assert not inside("test_ended_then_failed")
    assert captures("test_body_raises_in_capture") == [
        ("thread_local", f"test_suite.py:{_line('# in-with')}", False)
    ]
    assert inside("test_body_raises_in_capture")  # in flight when the window's end ran
    assert captures("test_no_capture") == [] and not inside("test_no_capture")
    # The window test_left_open left open is not the next tests' own.
    assert all(Signal.FAILED_IN_CAPTURE not in r["signals"] for r in rows.values()
               if r["nodeid"].endswith("test_no_capture"))  # fmt: skip
