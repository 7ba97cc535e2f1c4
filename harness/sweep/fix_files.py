"""The verified patches a sweep writes into --out/fixes, and applying one to a file's text.

`capsafe sweep --fix` writes, per victim with a verified patch, `fixes/<slug>.patch` (the
unified diff, for `git apply` or a reviewer) and `fixes/<slug>.json` (the victim, the file,
its sha256 when the sweep read it and once patched, the diff, where the patch came from,
its evidence and the command that applies it). `capsafe fix` reads them back (harness.sweep
.fix_cli). One file's patches are applied one after another to its text, each hunk where
its context stands (the lines may have moved by what an earlier patch added), so two
victims' patches to one test file apply together; a hunk whose context is not there is an
error, never a guess.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FIXES_DIR = "fixes"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_NEWLINE = "\\ No newline at end of file"
LINE = re.compile(r"[^\n]*\n|[^\n]+\Z")


class PatchError(Exception):
    """A diff that does not apply to the text it was given."""


def slug(nodeid: str) -> str:
    """A file name for a node id: readable, and unique by its hash."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:80]
    return f"{readable}-{hashlib.sha1(nodeid.encode()).hexdigest()[:8]}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FixFile:
    """One verified patch as fixes/<slug>.json holds it."""

    victim: str
    kind: str  # the verdict it fixes: order-dependent or brittle
    rootdir: str  # absolute: where `path` is, the suite's rootdir at the sweep
    path: str  # relative to rootdir
    sha256_before: str
    sha256_after: str  # of the file with this patch alone applied
    diff: str
    source: str  # idiom, cleaner or state-setter
    how: str
    apply: str  # the command that applies it
    causes: list[str] = field(default_factory=list)
    cleaners: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> Path:
        return Path(self.rootdir) / self.path

    def write(self, fixes: Path) -> Path:
        """fixes/<slug>.json and fixes/<slug>.patch; the json's path."""
        fixes.mkdir(parents=True, exist_ok=True)
        name = slug(self.victim)
        (fixes / f"{name}.patch").write_text(self.diff, encoding="utf-8")
        path = fixes / f"{name}.json"
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        return path


def read_fixes(fixes: Path) -> list[FixFile]:
    """Every fixes/*.json, by victim; ValueError naming a file that is not one."""
    found = []
    for path in sorted(fixes.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            found.append(FixFile(**data))
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a capsafe fix ({exc})") from None
    return sorted(found, key=lambda f: f.victim)


def apply_diff(text: str, diff: str) -> str:
    """`text` with the unified diff's hunks applied, each where its old lines stand nearest
    to the line it names. A hunk whose new lines stand there already is left as it is (an
    earlier patch of the same file made the same change: two polluters' patches both add
    `import functools` after the same line). PatchError when a hunk's old lines, and its
    new ones, are nowhere after the last hunk's."""
    lines = _lines(text)
    out: list[str] = []
    pos = 0
    for start, old, new in _hunks(diff):
        at = _find(lines, old, start, pos)
        if at is not None:
            out += lines[pos:at]
            out += new
            pos = at + len(old)
            continue
        done = _find(lines, new, start, pos) if new else None
        if done is None:
            shown = "".join(old[:3]).rstrip("\n") or "(an empty file)"
            raise PatchError(f"a hunk at line {start + 1} does not match:\n{shown}")
        out += lines[pos : done + len(new)]
        pos = done + len(new)
    out += lines[pos:]
    return "".join(out)


def is_applied(text: str, diff: str) -> bool:
    """Does every hunk's new text stand in `text`, in order (the patch is in already)?"""
    lines, pos = _lines(text), 0
    for start, _, new in _hunks(diff):
        at = _find(lines, new, start, pos)
        if at is None:
            return False
        pos = at + len(new)
    return True


def _hunks(diff: str) -> list[tuple[int, list[str], list[str]]]:
    """(0-based start, old lines, new lines) of each hunk."""
    hunks: list[tuple[int, list[str], list[str]]] = []
    old: list[str] = []
    new: list[str] = []
    last = ""  # the side of the line before, for "\ No newline at end of file"
    for line in _lines(diff):
        match = HUNK.match(line)
        if match:
            start = int(match.group(1)) - (0 if match.group(2) == "0" else 1)
            old, new = [], []
            hunks.append((start, old, new))
        elif not hunks:
            continue  # the ---/+++ header
        elif line.rstrip("\r\n") == NO_NEWLINE:
            for side, kept in (("-", old), ("+", new)):
                if last in (side, " ") and kept:
                    kept[-1] = kept[-1].rstrip("\r\n")
        elif line[:1] in (" ", "-", "+"):
            body = line[1:] if line.endswith("\n") or len(line) > 1 else "\n"
            last = line[0]
            if last in (" ", "-"):
                old.append(body)
            if last in (" ", "+"):
                new.append(body)
        elif line in ("\n", ""):
            old.append("\n")  # an empty context line some tools write without its space
            new.append("\n")
    return hunks


def _lines(text: str) -> list[str]:
    """`text` cut after each "\n" only, ends kept ("\r\n" stays whole): str.splitlines also
    cuts at a form feed and other separators a source line may hold."""
    return LINE.findall(text)


def _find(lines: list[str], old: list[str], start: int, pos: int) -> int | None:
    """Where `old` stands in `lines` at or after `pos`, nearest `start`."""
    size = len(old)
    places = range(pos, len(lines) - size + 1)
    for at in sorted(places, key=lambda k: abs(k - start)):
        if lines[at : at + size] == old:
            return at
    return None
