"""worker_reads: which of the suite's own code read xdist's worker variables at import."""

from __future__ import annotations

import os
from pathlib import Path

from capsafe_harness.sweep import worker_reads

READS = 'import os\nWORKER = os.environ.get("PYTEST_XDIST_WORKER")\nCOUNT = "{}" in os.environ\n'


def run_as(path: Path, source: str) -> None:
    """`source` run as if it were the file at `path` (its frames carry that file name)."""
    exec(compile(source, str(path), "exec"), {})


def test_reads_in_the_suite_are_named_by_file_and_line_and_others_are_not(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    worker_reads.start()
    try:
        run_as(root / "conftest.py", READS.format(worker_reads.COUNT))
        run_as(tmp_path / "elsewhere.py", READS.format(worker_reads.RUN_UID))
        run_as(root / "test_home.py", 'import os\nHOME = os.environ.get("HOME")\n')
    finally:
        worker_reads.stop()
    assert type(os.environ) is os._Environ  # the plain class again, the same object
    assert worker_reads.suite_reads(root) == ["conftest.py:2", "conftest.py:3"]


def test_nothing_is_noted_once_stopped(tmp_path: Path) -> None:
    root = tmp_path / "quiet"
    run_as(root / "conftest.py", READS.format(worker_reads.WORKER))
    assert worker_reads.suite_reads(root) == []
