"""Trying a patch without touching the user's tree: a scratch copy of the rootdir, one
candidate file written into it at a time, and the replays that decide whether it fixes.

The checks (docs/fixes.md): an order-dependent victim passes after its causes `times` times,
passes alone, and its module still passes; a brittle test passes alone `times` times and its
module still passes. "Its module passes" means no test of the module (and of the patched file,
when the patch is in another one) that passed before the patch fails with it, and the victim
passes there. A candidate that does not parse never reaches a replay.
"""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import libcst as cst

from .locate import module_tests

if TYPE_CHECKING:
    from .case import ReplayIn

SKIPPED_DIRS = frozenset(
    {".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
     ".tox", ".nox", "node_modules"}
)  # fmt: skip
"""Directories never copied into the scratch tree (caches, VCS data); virtualenvs (a
pyvenv.cfg inside), a sweep's own --out (raw/journal.jsonl inside) and special files (a FIFO
or a socket a test left) are left out too."""


class OutOfBudget(Exception):
    """The sweep's fixing budget ran out before the next replay."""


def _ignored(directory: str, names: list[str]) -> set[str]:
    here = Path(directory)
    return {
        n
        for n in names
        if n in SKIPPED_DIRS
        or _special(here / n)
        or (here / n / "pyvenv.cfg").is_file()
        or (here / n / "raw" / "journal.jsonl").is_file()
    }


def _special(path: Path) -> bool:
    """A FIFO, a socket, a device: nothing a test file is, and copying one blocks or fails."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return True
    return not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode))


class Scratch:
    """A copy of the rootdir (symlinks copied as links, never followed out of the tree)
    that candidate files are written into, one at a time; removed on exit."""

    def __init__(self, rootdir: Path) -> None:
        self._base = Path(tempfile.mkdtemp(prefix="capsafe-fix-"))
        self.root = self._base / rootdir.name
        shutil.copytree(rootdir, self.root, symlinks=True, ignore=_ignored)
        self._original: dict[str, bytes] = {}

    def __enter__(self) -> Scratch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        shutil.rmtree(self._base, ignore_errors=True)

    def write(self, path: str, source: str) -> None:
        """`path` (relative to the rootdir) holds `source` until `restore`."""
        target = self.root / path
        if path not in self._original:
            self._original[path] = target.read_bytes()
        if target.is_symlink():  # a link may lead out of the tree: write a file of our own
            target.unlink()
        target.write_bytes(source.encode("utf-8"))  # line endings as the candidate has them
        _forget_bytecode(target)

    def restore(self) -> None:
        """Every written file back to what the rootdir had."""
        for path, data in self._original.items():
            target = self.root / path
            target.write_bytes(data)
            _forget_bytecode(target)
        self._original.clear()


def _forget_bytecode(source: Path) -> None:
    """Drop the cached bytecode of `source` (Python's and pytest's assertion rewriting):
    both trust a cache whose recorded mtime and size match, and two candidates written in
    the same second can have the same size."""
    for cached in (source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


def parses(source: str) -> bool:
    """Does the patched file still parse (libcst) and compile (CPython)?"""
    try:
        cst.parse_module(source)
        compile(source, "<patch>", "exec")
    except (cst.ParserSyntaxError, SyntaxError, ValueError):
        return False
    return True


class Checker:
    """Runs the checks of one case in a scratch tree, counting every replay for the evidence."""

    def __init__(
        self,
        scratch: Scratch,
        replay: ReplayIn,
        budget_left: Callable[[], bool],
        *,
        victim: str,
        kind: Literal["order-dependent", "brittle"],
        causes: Sequence[str],
        times: int,
        collected: Sequence[str] = (),
        named: Sequence[str] = (),
    ) -> None:
        self.scratch = scratch
        self._replay = replay
        self._budget_left = budget_left
        self.victim = victim
        self.kind = kind
        self.causes = tuple(causes)
        self.times = max(1, times)
        self.replays = 0
        self._baselines: dict[str, Mapping[str, bool | None]] = {}
        self._collected = tuple(collected)
        self._named = tuple(dict.fromkeys([*named, *causes, victim]))
        self.module_ids: dict[str, tuple[str, list[str]]] = {}  # path -> (from where, ids)

    def run(self, sequence: Sequence[str]) -> Mapping[str, bool | None]:
        if not self._budget_left():
            raise OutOfBudget
        self.replays += 1
        return self._replay(self.scratch.root, list(sequence))

    def reproduce_sequence(self) -> list[str]:
        """What makes the victim misbehave: its causes then it (order-dependent), it alone
        (brittle)."""
        if self.kind == "brittle":
            return [self.victim]
        return [*self.causes, self.victim]

    def victim_passes(self) -> bool:
        """One replay of the reproducing sequence: did the victim run and pass?"""
        return self.run(self.reproduce_sequence()).get(self.victim) is False

    def baseline(self, path: str) -> Mapping[str, bool | None]:
        """The module's tests run in the unpatched scratch tree (once per module).

        Which tests: those the sweep collected in it; else those its source names, and when
        none of those ran (an id collection does not know, from a parametrized fixture, makes
        the whole replay refuse), only the tests of the case in it. The evidence says which.
        """
        if path in self._baselines:
            return self._baselines[path]
        ids = [n for n in self._collected if n.split("::", 1)[0] == path]
        origin = "collected"
        if not ids:
            module = cst.parse_module((self.scratch.root / path).read_text(encoding="utf-8"))
            keep = self.victim if self.victim.split("::", 1)[0] == path else ""
            ids, origin = module_tests(module, path, keep=keep), "source"
        result = self.run(ids)
        if origin == "source" and all(v is None for v in result.values()):
            ids = [n for n in self._named if n.split("::", 1)[0] == path]
            origin = "the case's own tests (the source's ids did not all collect)"
            result = self.run(ids) if ids else {}
        self.module_ids[path] = (origin, ids)
        self._baselines[path] = result
        return result

    def verify(self, path: str, source: str) -> dict[str, object] | None:
        """Evidence that `source` in place of `path` fixes the victim, or None if it does not.

        The scratch tree is left unpatched either way.
        """
        if not parses(source):
            return None
        modules = list(dict.fromkeys([self.victim.split("::", 1)[0], path]))
        for module in modules:  # before the candidate is written: the unpatched outcome
            self.baseline(module)
        self.scratch.write(path, source)
        try:
            return self._checks(modules)
        finally:
            self.scratch.restore()

    def _checks(self, modules: list[str]) -> dict[str, object] | None:
        sequence = self.reproduce_sequence()
        for _ in range(self.times):
            if self.run(sequence).get(self.victim) is not False:
                return None
        evidence: dict[str, object] = {"reproducing_sequence": sequence, "passes": self.times}
        if self.kind == "order-dependent":
            if self.run([self.victim]).get(self.victim) is not False:
                return None
            evidence["alone_passes"] = 1
        for module in modules:
            before = self.baseline(module)
            origin, ids = self.module_ids[module]
            after = self.run(ids) if ids else {}
            broken = sorted(t for t, failed in after.items() if failed and before.get(t) is False)
            if broken or (module == modules[0] and after.get(self.victim) is not False):
                return None
            evidence[f"module {module}"] = {
                "tests": origin,
                "ran": sum(1 for v in after.values() if v is not None),
                "failed": sorted(t for t, failed in after.items() if failed),
                "failed_before": sorted(t for t, failed in before.items() if failed),
            }
        return evidence
