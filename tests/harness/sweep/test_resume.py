"""--resume keeps every finished replay (issue 24): alone reruns, searches, screens and
their verifications are served from the records of the sweep before, never run again.

The planted suite's own conftest counts the test processes: every process appends its
run id and the sequence it replays to a file in the sweep's shared directory, which
--resume keeps. `--workers 1` makes the sweep ask its questions in one order, so an
uninterrupted sweep is the reference for what an interrupted-then-resumed one runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

CONFTEST = """
import os
import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def _count_process():
    args = dict(a.split("=", 1) for a in sys.argv if a.startswith("--capsafe-") and "=" in a)
    run_id = args.get("--capsafe-run-id", "?")
    if not run_id.startswith("run-"):  # a replay: what it asked
        with open(args["--capsafe-replay"], encoding="utf-8") as f:
            asked = " ".join(f.read().split())
        kind = run_id.rsplit("-", 1)[0]
        with open(os.path.join(os.environ["CAPSAFE_SWEEP_SHARED"], "processes.txt"), "a") as f:
            f.write(f"{kind} {asked}\\n")
    yield
"""
SUITE = {
    "conftest.py": CONFTEST,
    "state.py": "STATE = {}\n",
    "test_a.py": "from state import STATE\ndef test_pollute(): STATE['x'] = 1\n",
    "test_b.py": "from state import STATE\ndef test_victim(): assert 'x' not in STATE\n",
    "test_c.py": "from state import STATE\ndef test_set(): STATE['y'] = 1\n",
    "test_d.py": "from state import STATE\ndef test_brittle(): assert 'y' in STATE\n",
    **{f"test_pad{i}.py": f"def test_pad{i}(): pass\n" for i in range(4)},
}


def make_suite(path: Path) -> Path:
    path.mkdir()
    for name, text in SUITE.items():
        (path / name).write_text(text)
    return path


def sweep_cmd(out: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", ".", "--out", str(out),
            "--runs", "3", "--workers", "1", "--seed", "2", "--timeout", "10", *more,
            "--", "-p", "no:run-parallel", "-p", "no:hypothesispytest"]  # fmt: skip


def processes(out: Path) -> Counter[str]:
    path = out / "raw" / "shared" / "processes.txt"
    return Counter(path.read_text().splitlines()) if path.exists() else Counter()


def verdicts(out: Path) -> dict[str, Any]:
    tests = json.loads((out / "summary.json").read_text())["tests"]
    return {t["nodeid"]: (t["classification"], t["polluters"], t["state_setters"]) for t in tests}


@pytest.mark.slow  # three sweeps of a small suite
@pytest.mark.timeout(900)
def test_an_interrupted_sweep_resumed_runs_no_finished_replay_again(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite")
    whole = tmp_path / "whole"
    done = subprocess.run(sweep_cmd(whole), cwd=suite, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr
    reference = processes(whole)
    assert verdicts(whole)["test_b.py::test_victim"][1] == ["test_a.py::test_pollute"]
    assert verdicts(whole)["test_d.py::test_brittle"][2] == ["test_c.py::test_set"]
    assert sum(reference.values()) >= 10, reference

    # Resuming a finished sweep runs nothing: every replay is served from its records.
    again = subprocess.run(sweep_cmd(whole, "--resume"), cwd=suite, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert again.returncode == 1, again.stderr
    assert processes(whole) == reference
    assert verdicts(whole) == verdicts(tmp_path / "whole")

    # Interrupted halfway through the replays, then resumed: what finished is not redone.
    cut = tmp_path / "cut"
    journal = cut / "raw" / "journal.jsonl"
    sweep = subprocess.Popen(sweep_cmd(cut), cwd=suite, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    half = sum(reference.values()) // 2
    deadline = time.monotonic() + 600
    while sweep.poll() is None and time.monotonic() < deadline:
        if journal.exists() and len(journal.read_text().splitlines()) >= half:
            # SIGTERM takes the Ctrl-C path (termination.py); SIGINT would be ignored where
            # this runs as a shell's background job, which starts children with it ignored.
            sweep.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, err = sweep.communicate(timeout=600)
    assert sweep.returncode == 130, err
    before = len(json.loads((cut / "sweep.json").read_text())["processes"])
    resumed = subprocess.run(sweep_cmd(cut, "--resume"), cwd=suite, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 1, resumed.stderr
    ran = processes(cut)
    assert verdicts(cut) == verdicts(whole)
    redone = ran - reference  # at most the one process the interrupt cut off ran twice
    assert sum(redone.values()) <= 1 and not reference - ran, (redone, reference - ran, before)
