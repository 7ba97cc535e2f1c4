"""One catalogue of classes: a class added there, and nowhere else, is in every output.

The harness is copied to a temporary directory, one class is added to its catalogue
(the only file edited), and a real sweep of a one-test suite is run with that copy
first on the path: the new class must be in `capsafe sweep --help`, the console's
worst-tests line, report.md, report.html, tests.csv and the generated docs table.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[3] / "harness"
NEW_MEMBER = '    FLAKY = "flaky"\n'
NEW_CLASS = "    Class(Verdict.ERROR, 0,"


def _with_a_new_class(root: Path) -> Path:
    """A copy of the harness, importable as capsafe_harness, whose catalogue has
    `half-done` (checked right after `error`, so this suite's one test gets it)."""
    copy = root / "capsafe_harness"
    shutil.copytree(HARNESS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    catalogue = copy / "verdicts" / "catalogue.py"
    text = catalogue.read_text()
    assert NEW_MEMBER in text and NEW_CLASS in text
    text = text.replace(NEW_MEMBER, NEW_MEMBER + '    HALF_DONE = "half-done"\n', 1)
    entry = (
        '    Class(Verdict.HALF_DONE, 3, "#123456", "left half done", "`test_todo`",\n'
        '          "its name says it is not finished",\n'
        '          lambda e: e.ran and e.nodeid.endswith("test_todo"),\n'
        '          lambda e, _: "its name says so"),\n'
    )
    at = text.index("    Class(Verdict.PASS,")  # checked before pass, after error
    catalogue.write_text(text[:at] + entry + text[at:])
    return root


@pytest.mark.slow
def test_a_class_added_to_the_catalogue_alone_is_in_every_output(tmp_path: Path) -> None:
    path = _with_a_new_class(tmp_path / "copy")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_it.py").write_text("def test_todo():\n    pass\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]),
    }
    probe = subprocess.run(
        [sys.executable, "-c", "import capsafe_harness; print(capsafe_harness.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert probe.stdout.strip().startswith(str(path))  # the copy, not the installed harness

    helptext = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--help"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "half-done" in helptext and "its name says it is not finished" in helptext

    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite), "--runs", "1",
         "--workers", "0", "--isolation-runs", "1", "--seed", "1", "--out", str(out)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # a class other than pass was found
    console = [line for line in done.stderr.splitlines() if "test_todo" in line]
    assert console and console[0].split()[0] == "half-done"
    assert "its name says so" in console[0]

    markdown = (out / "report.md").read_text()
    assert "| half-done |" in markdown
    page = (out / "report.html").read_text()
    assert "half-done" in page and "#123456" in page and "left half done" in page
    with open(out / "tests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["classification"] for r in rows] == ["half-done"]

    table = subprocess.run(
        [sys.executable, "-m", "capsafe_harness.verdicts.catalogue"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "| `half-done` | `test_todo` | its name says it is not finished |" in table
