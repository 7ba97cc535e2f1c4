"""`capsafe fix OUT [TEST...]` (issue 25): applies the verified patches only when asked,
refuses a file changed since the sweep, and answers a user's mistake in one line."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from capsafe.cli import main
from capsafe_harness.sweep.fix_files import FIXES_DIR, FixFile, apply_diff, sha256

BEFORE = "import registry\n\n\ndef test_register():\n    registry.add('x')\n"
FIRST = BEFORE.replace("import registry\n", "import registry\nimport pytest\n")
SECOND = BEFORE + "    registry.clear()\n"


def fix_for(root: Path, victim: str, after: str) -> FixFile:
    old, new = BEFORE.splitlines(keepends=True), after.splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(old, new, "a/t.py", "b/t.py"))
    return FixFile(victim, "order-dependent", str(root), "t.py", sha256(BEFORE.encode()),
                   sha256(after.encode()), diff, "idiom", f"fixes {victim}",
                   f"capsafe fix OUT {victim}")  # fmt: skip


@pytest.fixture
def swept(tmp_path: Path) -> Path:
    """A sweep's --out with two patches of one file, and that file as the sweep read it."""
    root, out = tmp_path / "suite", tmp_path / "out"
    root.mkdir()
    (root / "t.py").write_text(BEFORE)
    out.mkdir()
    (out / "sweep.json").write_text("{}")
    for victim, after in (("t.py::test_a", FIRST), ("t.py::test_b", SECOND)):
        fix_for(root, victim, after).write(out / FIXES_DIR)
    return out


def target(out: Path) -> Path:
    return out.parent / "suite" / "t.py"


def test_every_patch_is_applied(swept: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fix", str(swept)]) == 0
    assert target(swept).read_text() == apply_diff(FIRST, fix_for(swept, "", SECOND).diff)
    assert "patched" in capsys.readouterr().err


def test_only_the_named_test_and_then_it_is_already_applied(swept: Path) -> None:
    assert main(["fix", str(swept), "t.py::test_b"]) == 0
    assert target(swept).read_text() == SECOND
    assert main(["fix", str(swept), "t.py::test_b"]) == 0
    assert target(swept).read_text() == SECOND


def test_a_file_changed_since_the_sweep_is_refused(
    swept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target(swept).write_text(BEFORE + "# edited\n")
    assert main(["fix", str(swept)]) == 1
    assert target(swept).read_text() == BEFORE + "# edited\n"
    err = capsys.readouterr().err
    assert "changed since the sweep" in err and "sweep again with --fix" in err


def test_dry_run_prints_the_diffs_and_changes_nothing(
    swept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fix", str(swept), "--dry-run"]) == 0
    assert target(swept).read_text() == BEFORE
    out = capsys.readouterr().out
    assert "# t.py::test_a: fixes t.py::test_a" in out and "+import pytest" in out


@pytest.mark.parametrize(
    ("change", "args", "said"),
    [
        ("none", ["missing"], "no such directory"),
        ("no-state", [], "holds no capsafe sweep"),
        ("no-fixes", [], "ran without --fix"),
        ("none", ["t.py::test_c"], "no verified patch for t.py::test_c"),
    ],
)
def test_a_users_mistake_is_one_line(
    swept: Path, capsys: pytest.CaptureFixture[str], change: str, args: list[str], said: str
) -> None:
    if change == "no-state":
        (swept / "sweep.json").unlink()
    if change == "no-fixes":
        for path in (swept / FIXES_DIR).iterdir():
            path.unlink()
        (swept / FIXES_DIR).rmdir()
    out = swept.parent / args[0] if args[:1] == ["missing"] else swept
    assert main(["fix", str(out), *[a for a in args if a != "missing"]]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_patch_that_no_longer_applies_is_left_out_and_the_others_written(
    swept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clash = BEFORE.replace("import registry\n", "import registry as reg\n")
    fix_for(swept.parent / "suite", "t.py::test_c", clash).write(swept / FIXES_DIR)
    assert main(["fix", str(swept)]) == 1
    assert target(swept).read_text() == apply_diff(FIRST, fix_for(swept, "", SECOND).diff)
    err = capsys.readouterr().err
    assert "the patch for t.py::test_c does not apply after the others" in err
    assert "patched" in err


def test_a_file_with_every_patch_in_is_already_patched(swept: Path) -> None:
    assert main(["fix", str(swept)]) == 0
    patched = target(swept).read_text()
    assert main(["fix", str(swept)]) == 0
    assert target(swept).read_text() == patched
