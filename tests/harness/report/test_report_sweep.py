"""Problem 10 end to end: what `capsafe sweep` writes for a person to read."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
from pathlib import Path

SUITE = """
    import os
    import pytest

    def test_ok():
        pass

    def test_leaks():
        os.environ["CAPSAFE_LEFT_ON"] = "yes"

    def test_broken():
        value = 2
        assert value == 3, "the planted message"

    def test_skipped():
        pytest.skip("needs a GPU")

    @pytest.mark.xfail(reason="known bug 12")
    def test_known():
        assert 0

    @pytest.mark.xfail(reason="maybe fixed")
    def test_fixed():
        pass
"""


def test_sweep_report_shows_messages_outcomes_and_env_leaks(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_mix.py").write_text(textwrap.dedent(SUITE))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", "suite", "--runs", "1",
         "--workers", "0", "--isolation-runs", "1", "--seed", "5", "--out", str(out),
         "--", "-p", "no:hypothesispytest"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    broken = "test_mix.py::test_broken"
    assert f"### `{broken}` (fail)" in md
    assert "AssertionError: the planted message" in md
    assert "<details><summary>full output</summary>" in md and "value = 2" in md
    assert '<pre class="msg">AssertionError: the planted message' in page
    assert "| `test_mix.py::test_skipped` | skipped | skipped " in md
    assert "| Skipped: needs a GPU |" in md
    assert "| expected to fail (known bug 12): assert 0 |" in md
    assert "| `test_mix.py::test_fixed` | xpassed |" in md
    assert "| `test_mix.py::test_leaks` | pass | `CAPSAFE_LEFT_ON` | unset | `yes` |" in md
    with open(out / "tests.csv", newline="") as f:
        rows = {r["nodeid"].split("::")[1]: r for r in csv.DictReader(f)}
    assert {name: r["outcome"] for name, r in rows.items()} == {
        "test_ok": "passed", "test_leaks": "passed", "test_broken": "failed",
        "test_skipped": "skipped", "test_known": "xfailed", "test_fixed": "xpassed",
    }  # fmt: skip
    assert rows["test_leaks"]["env_leaks"] == "CAPSAFE_LEFT_ON: unset -> 'yes'"
    # Skipped, xfailed and xpassed tests were counted as pass, their reasons in red boxes.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcomes"] == {"skipped": 1, "xfailed": 1, "xpassed": 1}
    assert summary["counts"]["pass"] == 5  # the class: none of them failed
    headline = "1 of 6 tests need attention. 1 skipped, 1 xfailed, 1 xpassed not counted as pass."
    assert headline in md and headline in page
    header, _, counts = md.splitlines()[4:7]
    assert dict(zip(header.split("|"), counts.split("|"), strict=True))[" pass "] == " 2 "
    assert '<pre class="msg reason">expected to fail (known bug 12)' in page
    assert '<pre class="msg">expected to fail' not in page
    assert '<pre class="msg">Skipped' not in page


def test_a_suite_of_skips_and_xfails_is_not_all_pass(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_mix.py").write_text(textwrap.dedent(OTHERS))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", "suite", "--runs", "1",
         "--workers", "0", "--isolation-runs", "1", "--seed", "5", "--out", str(out),
         "--", "-p", "no:hypothesispytest"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    said = "all 1 tests that ran pass; 1 skipped, 1 xfailed not counted as pass"
    assert said in done.stderr.splitlines()[-1]
    assert f"{said[0].upper()}{said[1:]}." in (out / "report.md").read_text()


OTHERS = """
    import pytest

    def test_ok():
        pass

    def test_skipped():
        pytest.skip("needs a GPU")

    @pytest.mark.xfail(reason="known bug 12")
    def test_known():
        assert 0
"""
