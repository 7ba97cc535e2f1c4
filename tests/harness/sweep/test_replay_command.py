"""The replay command a report shows: short, relative to where the sweep ran, and exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FAILING = "def test_ok():\n    pass\n\ndef test_broken():\n    assert 2 == 3\n"


def test_replay_is_relative_to_where_the_sweep_ran_and_reproduces(tmp_path: Path) -> None:
    suite = tmp_path / "project" / "tests"
    suite.mkdir(parents=True)
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_x.py").write_text(FAILING)
    out = tmp_path / "project" / "reports" / "r"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "tests", "--runs", "1", "--workers",
         "0", "--isolation-runs", "1", "--seed", "1", "--out", "reports/r", "--no-progress",
         "--", "-p", "no:run-parallel"],
        cwd=tmp_path / "project", capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    tests = {t["nodeid"]: t for t in json.loads((out / "summary.json").read_text())["tests"]}
    replay = tests["test_x.py::test_broken"]["replay"]
    assert str(tmp_path) not in replay, replay  # it was ~600 characters of absolute paths
    assert " tests/test_x.py " in replay and " --rootdir=tests " in replay
    assert " --capsafe-replay=reports/r/replays/" in replay
    again = subprocess.run(replay, shell=True, cwd=tmp_path / "project", capture_output=True,
                           text=True, timeout=240)  # fmt: skip
    assert again.returncode == 1 and "1 failed" in again.stdout, again.stdout + again.stderr
