"""Applying the diffs `capsafe sweep --fix` writes (issue 25): exactly as `patch` would,
one after another on one file, and an error (never a guess) where a hunk does not match."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from capsafe_harness.sweep.fix_files import (
    FixFile,
    PatchError,
    apply_diff,
    is_applied,
    read_fixes,
    slug,
)

BEFORE = "".join(f"line {i}\n" for i in range(1, 21))


def diff(before: str, after: str) -> str:
    """The diff git writes: lines cut at "\n" only."""
    old, new = re.findall(r"[^\n]*\n|[^\n]+$", before), re.findall(r"[^\n]*\n|[^\n]+$", after)
    return "".join(difflib.unified_diff(old, new, "a/t.py", "b/t.py"))


def edited(text: str, at: int, new: str) -> str:
    lines = text.splitlines(keepends=True)
    lines.insert(at, new)
    return "".join(lines)


def test_a_diff_gives_back_the_text_it_was_made_from() -> None:
    after = edited(edited(BEFORE, 2, "inserted a\n"), 15, "inserted b\n").replace("line 9\n", "")
    assert apply_diff(BEFORE, diff(BEFORE, after)) == after


def test_two_patches_of_one_file_apply_one_after_the_other() -> None:
    first, second = edited(BEFORE, 1, "first\n"), edited(BEFORE, 18, "second\n")
    both = apply_diff(apply_diff(BEFORE, diff(BEFORE, first)), diff(BEFORE, second))
    assert both == edited(edited(BEFORE, 18, "second\n"), 1, "first\n")


def test_a_hunk_whose_context_is_gone_is_an_error() -> None:
    patch = diff(BEFORE, edited(BEFORE, 5, "new\n"))
    with pytest.raises(PatchError, match="does not match"):
        apply_diff(BEFORE.replace("line 5\n", "changed\n"), patch)


def test_a_file_without_its_last_newline() -> None:
    before, after = "a\nb", "a\nx\nb"
    patch = diff(before, after).replace("\n+x\n b", "\n+x\n b\n\\ No newline at end of file\n")
    assert apply_diff(before, patch) == after


def test_fix_files_round_trip(tmp_path: Path) -> None:
    fix = FixFile("t.py::test_v", "order-dependent", str(tmp_path), "t.py", "0" * 64, "1" * 64,
                  "--- a/t.py\n", "idiom", "restores X", "capsafe fix OUT t.py::test_v",
                  ["t.py::test_p"])  # fmt: skip
    written = fix.write(tmp_path / "fixes")
    assert written.name == f"{slug(fix.victim)}.json"
    assert (tmp_path / "fixes" / f"{slug(fix.victim)}.patch").read_text() == fix.diff
    assert read_fixes(tmp_path / "fixes") == [fix]
    (tmp_path / "fixes" / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match=r"junk\.json is not a capsafe fix"):
        read_fixes(tmp_path / "fixes")


def test_crlf_and_form_feed_lines_apply_as_they_are() -> None:
    """A line is cut at "\n" only: CRLF ends stay whole, and a form feed (old sources hold
    them between sections) is part of its line, as in the diff."""
    before = "a = 1\r\n\x0c\r\nb = 2\r\n"
    after = "a = 1\r\n\x0c\r\nb = 3\r\n"
    assert apply_diff(before, diff(before, after)) == after


def test_two_patches_making_one_change_both_apply() -> None:
    """freezegun's two polluters are patched apart, each adding `import functools` after the
    same line and changing its own function: applied one after the other, the import is in
    once and both functions are changed."""
    pad = "".join(f"X{i} = {i}\n" for i in range(8))  # the hunks stand apart, as there
    before = f"import os\n{pad}\n\ndef test_a():\n    pass\n{pad}\n\ndef test_b():\n    pass\n"
    first = before.replace("import os\n", "import os\nimport functools\n").replace(
        "def test_a():", "def test_a(request):"
    )
    second = before.replace("import os\n", "import os\nimport functools\n").replace(
        "def test_b():", "def test_b(request):")  # fmt: skip
    both = apply_diff(apply_diff(before, diff(before, first)), diff(before, second))
    assert both == first.replace("def test_b():", "def test_b(request):")
    assert is_applied(both, diff(before, first)) and is_applied(both, diff(before, second))
    assert not is_applied(before, diff(before, second))
