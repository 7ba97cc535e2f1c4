"""--phase-budget: a phase that runs out says so, and what it left undone is never pass."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_sweep import FAST, by_id, make_suite, summary_of, sweep

from capsafe_harness.sweep.cli import phase_budget_option
from capsafe_harness.sweep.options import SweepError

FAILING = """
    def test_ok():
        pass

    def test_bad():
        assert False
"""


def test_a_phase_out_of_budget_leaves_its_tests_unverified_and_names_itself(
    tmp_path: Path,
) -> None:
    suite = make_suite(tmp_path / "suite", test_f=FAILING)
    out = tmp_path / "out"
    done = sweep(str(suite), "--runs", "2", "--workers", "0", "--phase-budget", "0.001",
                 "--out", str(out), *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr  # a failing test is still a failing sweep
    summary = summary_of(out)
    tests = by_id(summary)
    assert tests["test_f.py::test_bad"]["classification"] == "unverified"
    assert tests["test_f.py::test_bad"]["isolation_runs"] < 3  # the first ones may start in time
    assert tests["test_f.py::test_ok"]["classification"] == "pass"
    notes = summary["notes"]
    assert any(n.startswith("the isolation phase's budget of 0s ran out") for n in notes), notes
    # 3 reruns of test_bad and test_ok's screen: on a slow machine none may start in time
    assert any(re.fullmatch(r"isolation phase budget of 0s spent: skipped [1-4] isolation reruns",
                            n) for n in notes), notes  # fmt: skip


@pytest.mark.parametrize(
    ("text", "seconds"), [("auto", None), ("none", float("inf")), ("90", 90.0)]
)
def test_the_phase_budget_option(text: str, seconds: float | None) -> None:
    assert phase_budget_option(text) == seconds


@pytest.mark.parametrize("text", ["0", "-5", "soon", "nan"])
def test_a_phase_budget_that_is_no_positive_time_is_a_usage_error(text: str) -> None:
    with pytest.raises(SweepError, match="--phase-budget"):
        phase_budget_option(text)
