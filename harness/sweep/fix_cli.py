"""`capsafe fix OUT [TEST...]`: apply the verified patches a `capsafe sweep --fix` wrote.

Only when asked, and never over a file changed since the sweep: each file's sha256 must be
the one the sweep recorded (harness.sweep.fix_files), else that file is left alone and the
command says which and what to do. A file already patched (its sha256 is the patched one) is
skipped. Several patches of one file apply one after another. A user's mistake (no such OUT,
an OUT that is no sweep, a sweep without fixes, an unknown test) is one line and exit 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .fix_files import (
    FIXES_DIR,
    FixFile,
    PatchError,
    apply_diff,
    is_applied,
    read_fixes,
    sha256,
    slug,
)
from .state import STATE_FILE, describe_error

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2

EPILOG = """\
exit codes:
  0    every patch asked for is applied (or was already)
  1    some file changed since the sweep, or a patch did not apply: those files are
       left as they are, the others patched
  2    usage error: no such OUT, an OUT that holds no sweep or no fixes, an unknown TEST

example:
  capsafe sweep tests --fix --out reports/today
  capsafe fix reports/today --dry-run       # the diffs
  capsafe fix reports/today tests/test_a.py::test_reads_default
"""


class FixError(Exception):
    """A user's mistake: one line, exit 2."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "fix",
        help="apply the verified patches of a `capsafe sweep --fix` to the working tree",
        description=(
            "Apply the patches `capsafe sweep --fix` verified (OUT/fixes) to the files they "
            "change: all of them, or those of the TESTs named. A file whose content changed "
            "since the sweep is refused (its sha256 differs from the one recorded)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", type=Path, metavar="OUT", help="the --out of the sweep")
    parser.add_argument("tests", nargs="*", metavar="TEST",
                        help="node ids of the tests whose patches to apply "
                        "(default: all)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="print the diffs; change nothing")  # fmt: skip
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        fixes = chosen(load(args.out), args.tests)
    except FixError as exc:
        print(f"capsafe fix: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        for fix in fixes:
            print(f"# {fix.victim}: {fix.how}\n{fix.diff}", end="" if fix.diff.endswith("\n")
                  else "\n")  # fmt: skip
        return EXIT_OK
    complete = True
    for lines, ok in apply_all(fixes).values():
        for line in lines:
            print(f"capsafe fix: {line}", file=sys.stderr)
        complete &= ok
    return EXIT_OK if complete else EXIT_REFUSED


def load(out: Path) -> list[FixFile]:
    """The fixes in `out`; FixError for an OUT that is missing, no sweep, or holds none."""
    if not out.is_dir():
        raise FixError(f"no such directory: {out}")
    if not (out / STATE_FILE).is_file():
        raise FixError(f"{out} holds no capsafe sweep (no {STATE_FILE}): give the --out of "
                       "`capsafe sweep --fix`")  # fmt: skip
    try:
        fixes = read_fixes(out / FIXES_DIR)
    except ValueError as exc:
        raise FixError(str(exc)) from None
    if not fixes:
        how = ("its fixing phase verified no patch" if (out / FIXES_DIR).is_dir()
               else "it ran without --fix: sweep again with `capsafe sweep --fix`")  # fmt: skip
        raise FixError(f"no verified patches in {out}: {how}")
    return fixes


def chosen(fixes: Sequence[FixFile], tests: Sequence[str]) -> list[FixFile]:
    """The fixes of `tests` (all when none are named); FixError naming an unknown one."""
    if not tests:
        return list(fixes)
    by_victim = {f.victim: f for f in fixes}
    unknown = [t for t in tests if t not in by_victim]
    if unknown:
        known = ", ".join(sorted(by_victim)[:5]) + (", ..." if len(by_victim) > 5 else "")
        raise FixError(f"no verified patch for {unknown[0]} (patches are for: {known})")
    return [by_victim[t] for t in dict.fromkeys(tests)]


def apply_all(fixes: Sequence[FixFile]) -> dict[Path, tuple[list[str], bool]]:
    """Apply each file's patches; per file, what happened and whether every patch asked for
    is in (applied now or before)."""
    by_file: dict[Path, list[FixFile]] = {}
    for fix in fixes:
        by_file.setdefault(fix.target, []).append(fix)
    return {target: _apply_file(target, group) for target, group in by_file.items()}


def _apply_file(target: Path, fixes: Sequence[FixFile]) -> tuple[list[str], bool]:
    """One file's patches, one after another: one that no longer applies (its hunks overlap
    an earlier one's) is named and left out, the others written."""
    try:
        data = target.read_bytes()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{target}: not patched ({_names(fixes)}): {describe_error(exc)}"], False
    digest = sha256(data)
    if digest not in {f.sha256_before for f in fixes}:
        if _applied(text, fixes):
            return [f"already patched: {target} ({_names(fixes)})"], True
        recorded = sorted({f.sha256_before[:12] for f in fixes})
        return [f"{target}: not patched ({_names(fixes)}): it changed since the sweep (sha256 "
                f"{digest[:12]}, the sweep read {', '.join(recorded)}); sweep again with --fix, "
                "or apply the .patch files in the sweep's fixes/ by hand"], False  # fmt: skip
    lines, complete, before = [], True, text
    for fix in _unique(fixes):
        sharing = [f for f in fixes if f.diff == fix.diff]
        try:
            text = apply_diff(text, fix.diff)
        except PatchError as exc:
            complete = False
            lines.append(f"{target}: the patch for {_names(sharing)} does not apply after the "
                         f"others ({str(exc).splitlines()[0]}): apply fixes/"
                         f"{slug(fix.victim)}.patch by hand once they are in, or sweep again "
                         "with --fix")  # fmt: skip
            continue
        lines.append(f"{_names(sharing)}: {fix.how}")
    if text == before:
        return [*lines, f"{target}: not patched"], False
    try:
        target.write_text(text, encoding="utf-8", newline="")
    except OSError as exc:
        return [f"{target}: not patched ({_names(fixes)}): {describe_error(exc)}"], False
    return [*lines, f"patched {target}"], complete


def _applied(text: str, fixes: Sequence[FixFile]) -> bool:
    """Every patch's change stands in `text` already (`capsafe fix` ran before)."""
    return all(is_applied(text, fix.diff) for fix in _unique(fixes))


def _names(fixes: Sequence[FixFile]) -> str:
    """The victims a patch is for: a few by name, then how many more."""
    names = [f.victim for f in fixes]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _unique(fixes: Sequence[FixFile]) -> list[FixFile]:
    """One of each distinct diff: two victims of one polluter may share its patch."""
    seen: dict[str, FixFile] = {}
    for fix in fixes:
        seen.setdefault(fix.diff, fix)
    return list(seen.values())
