"""A test repeated in a replay list sets up and tears down its module every time:
harness.plugin.repeats."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# Every setup and teardown, of each level, appends its name to a log beside the tests.
LOGGED = """
import os
import pytest

LOG = os.path.join(os.path.dirname(__file__), "events.log")

def log(event):
    with open(LOG, "a") as f:
        f.write(event + "\\n")

def setup_module(module): log("setup_module")
def teardown_module(module): log("teardown_module")
def setup_function(function): log("setup_function")
def teardown_function(function): log("teardown_function")

@pytest.fixture(scope="session", autouse=True)
def session_fixture():
    log("session up")
    yield
    log("session down")

def test_one(): log("one")
def test_two(): log("two")
"""


def replayed(pytester: pytest.Pytester, tmp_path: Path, order: list[str]) -> list[str]:
    pytester.makepyfile(test_m=LOGGED)
    replay = tmp_path / "replay.txt"
    replay.write_text("".join(f"test_m.py::{name}\n" for name in order))
    result = pytester.runpytest("-p", "no:xdist", f"--capsafe-replay={replay}")
    result.assert_outcomes(passed=len(order))
    return (pytester.path / "events.log").read_text().splitlines()


def test_each_repetition_runs_its_module_setup_and_teardown(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    # python-fs's collisions are a teardown_module racing a setup_function: a test
    # repeated in a pair run must do both each time (they ran once, at either end).
    events = replayed(pytester, tmp_path, ["test_one"] * 3)
    once = ["setup_module", "setup_function", "one", "teardown_function", "teardown_module"]
    assert events == ["session up", *once * 3, "session down"]


def test_different_tests_of_one_module_still_share_it(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    events = replayed(pytester, tmp_path, ["test_one", "test_two", "test_two", "test_one"])
    assert events.count("setup_module") == 2  # once, then again after test_two's repetition
    assert events[:7] == ["session up", "setup_module", "setup_function", "one",
                          "teardown_function", "setup_function", "two"]  # fmt: skip
    assert events.count("session up") == 1  # the session stays set up
