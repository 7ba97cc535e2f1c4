"""The scratch copy candidate patches are tried in (what it copies; the user's tree is never
written) and the diff a patch is handed over as."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from capsafe_harness.fix.case import unified
from capsafe_harness.fix.idioms import rewrites
from capsafe_harness.fix.locate import find, read, site_of
from capsafe_harness.fix.verify import Scratch, parses


def test_the_scratch_copy_leaves_out_caches_venvs_and_a_sweeps_out(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    for rel in (
        "test_a.py", "pkg/__init__.py", ".git/HEAD", "__pycache__/test_a.cpython-311.pyc",
        ".pytest_cache/v", ".venv/pyvenv.cfg", ".venv/lib/x.py", "out/raw/journal.jsonl",
        "data/raw/other.txt",
    ):  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    os.mkfifo(root / "data" / "pipe")  # copying a FIFO blocks or fails: never copied
    with Scratch(root) as scratch:
        copied = {p.relative_to(scratch.root).as_posix() for p in scratch.root.rglob("*")}
        assert {"test_a.py", "pkg/__init__.py", "data/raw/other.txt"} <= copied
        for gone in (".git", "__pycache__", ".pytest_cache", ".venv", "out", "data/pipe"):
            assert gone not in copied, gone
        base = scratch.root
    assert not base.exists()


def test_writing_a_candidate_never_writes_through_a_link_out_of_the_tree(tmp_path: Path) -> None:
    outside = tmp_path / "outside.py"
    outside.write_text("ORIGINAL = 1\n")
    root = tmp_path / "suite"
    root.mkdir()
    (root / "test_a.py").write_text("def test_a():\n    pass\n")
    os.symlink(outside, root / "test_link.py")
    (root / "__pycache__").mkdir()
    with Scratch(root) as scratch:
        (scratch.root / "__pycache__").mkdir(exist_ok=True)
        stale = scratch.root / "__pycache__" / "test_a.cpython-311-pytest-8.3.pyc"
        stale.write_bytes(b"old")
        scratch.write("test_link.py", "PATCHED = 1\n")
        scratch.write("test_a.py", "def test_a():\n    assert 1\n")
        assert (scratch.root / "test_link.py").read_text() == "PATCHED = 1\n"
        assert not stale.exists()  # a cache of the old source must not be trusted
        scratch.restore()
        assert (scratch.root / "test_a.py").read_text() == "def test_a():\n    pass\n"
    assert outside.read_text() == "ORIGINAL = 1\n"
    assert (root / "test_a.py").read_text() == "def test_a():\n    pass\n"


def test_a_candidate_that_does_not_parse_is_refused() -> None:
    assert parses("def test_a(monkeypatch):\n    pass\n")
    assert not parses("def test_a(:\n    pass\n")
    assert not parses("def f():\n    return\nreturn 1\n")  # parses, does not compile


@pytest.mark.skipif(shutil.which("git") is None, reason="applies the diff with git")
@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_the_diff_applies_to_the_file_as_it_is(tmp_path: Path, ending: str) -> None:
    """Its own line endings, and no newline after its last line: the diff still applies."""
    lines = ["import os", "", "", "def test_p():", '    os.environ["A"] = "1"']
    original = ending.join(lines).encode()  # no newline at the end
    (tmp_path / "test_p.py").write_bytes(original)
    source, module = read(tmp_path, "test_p.py")
    polluter = find(module, site_of("test_p.py::test_p"))
    assert polluter is not None
    [rewrite], _ = rewrites("test_p.py::test_p", polluter, tmp_path, {})
    assert ending in rewrite.source and "\r\n" not in rewrite.source.replace(ending, "")
    diff = unified("test_p.py", source, rewrite.source)
    assert diff.startswith("--- a/test_p.py\n+++ b/test_p.py\n")
    assert "\\ No newline at end of file" in diff
    subprocess.run(["git", "apply", "-p1", "-"], cwd=tmp_path, input=diff.encode(), check=True)
    assert (tmp_path / "test_p.py").read_bytes() == rewrite.source.encode()
