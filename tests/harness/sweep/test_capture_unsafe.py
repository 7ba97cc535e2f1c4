"""`capture-unsafe` end to end on the sim backend: the planted capture suite under the sweep.

With neighbour threads the unprotected GLOBAL capture fails and the batched reruns without
them pass: capture-unsafe, with the call kinds that break it named (the allocator calls and
cuCtxSynchronize, not the legacy-stream work a nonblocking capture stream is immune to),
the mode inferred, the fix and a replay line. The capture taken through `capsafe.capture`
passes. (repro/suites/capture_polluter's answer key covers a capture-unsafe test beside an
order-dependent one in the same sweep.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SUITE = Path(__file__).resolve().parents[3] / "repro" / "suites" / "capture"
RAW = "test_capture.py::test_raw_global_capture"
PROTECTED = "test_capture.py::test_protected_capture"
LEAN = ["--", "-p", "no:run-parallel", "-p", "no:hypothesispytest"]


def sweep(
    out: Path, *options: str, suite: Path = SUITE
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], dict[str, dict[str, Any]]]:
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite),
         "--out", str(out), "--timeout", "10", "--seed", "3", "--workers", "2", *options, *LEAN],
        capture_output=True, text=True, timeout=570,
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    return done, summary, {t["nodeid"]: t for t in summary["tests"]}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_unprotected_capture_is_capture_unsafe_with_its_breaking_calls(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done, summary, tests = sweep(out, "--runs", "2", "--isolation-runs", "2", "--neighbors", "2")
    assert done.returncode == 1, done.stderr
    raw, protected = tests[RAW], tests[PROTECTED]
    assert (raw["classification"], protected["classification"]) == ("capture-unsafe", "pass")
    capture = raw["capture"]
    assert {"mem_alloc", "ctx_sync", "stream_sync_other"} <= set(capture["breaks"])
    assert {"memset_sync", "memcpy_htod_sync"} <= set(capture["survives"])
    assert capture["control_runs"] >= 1 and capture["control_failures"] == 0
    assert "GLOBAL mode on a nonblocking stream" in capture["advice"]
    assert "--capsafe-neighbor-calls=" in capture["replay"] and "ctx_sync" in capture["replay"]
    assert not any(s["victim"] == RAW for s in summary["searches"])  # never a cause search
    assert set(summary["phase_times"]["sweep_s"]) >= {"collection", "runs", "isolation"}
    assert summary["phase_times"]["process_s"]["pytest_start"] > 0
    assert summary["gpu"]["neighbors"]["calls"]["ctx_sync"] > 0
    md = (out / "report.md").read_text()
    assert f"`{RAW}` is capture-unsafe: breaks under: " in md and "capsafe.capture" in md
    assert "capture-unsafe" in (out / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_neighbours_nothing_is_capture_unsafe(tmp_path: Path) -> None:
    done, summary, tests = sweep(tmp_path / "report", "--runs", "1")
    assert done.returncode == 0, done.stderr
    assert {t["classification"] for t in tests.values()} == {"pass"}
    assert not summary["gpu"]["capture_unsafe"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_neighbours_that_cannot_start_stop_the_sweep(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    shutil.copytree(SUITE, suite)
    # The test processes get a backend the neighbours cannot bind; the sweep itself is fine.
    (suite / "conftest.py").write_text("import os\nos.environ['CAPSAFE_BACKEND'] = 'nope'\n")
    out = tmp_path / "report"
    done, _, tests = sweep(out, "--runs", "2", "--neighbors", "2", suite=suite)
    assert done.returncode == 2, done.stderr
    assert "neighbour threads could not start" in done.stderr and "nope" in done.stderr
    assert not tests  # no verdicts without them
    for report in ("report.md", "report.html"):
        assert "neighbour threads could not start" in (out / report).read_text()
