"""Where a suite's own code read xdist's worker variables while it was imported and collected.

An xdist worker imports the suite with `PYTEST_XDIST_WORKER` (and its count and run uid)
set; the fork server imports it once with none of them, and a suite run's forked children
get them only after the fork (fork_server._as_xdist_worker). A conftest that picks a
port, a database name or a skip at import from the worker id would therefore see the
same value in every child, where xdist's workers each see their own: such a suite's runs
stay under xdist. `start()` records, until `stop()`, each read of those variables
through `os.environ` (`os.getenv`, `.get`, `in`, `[]`) with the first calling frame
outside the standard library; `suite_reads` keeps those under the suite's root and
outside installed packages (pytest-benchmark reads `PYTEST_XDIST_WORKER` at configure,
for itself).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from types import FrameType

__all__ = ["COUNT", "RUN_UID", "VARIABLES", "WORKER", "start", "stop", "suite_reads"]

WORKER = "PYTEST_XDIST_WORKER"
COUNT = "PYTEST_XDIST_WORKER_COUNT"
RUN_UID = "PYTEST_XDIST_TESTRUNUID"
VARIABLES = (WORKER, COUNT, RUN_UID)  # what an xdist worker sets for itself
_STDLIB = (os.path.dirname(os.__file__), "<frozen")
_reads: list[tuple[str, int]] = []  # (file, line) of each read, in order


class _WatchedEnviron(os._Environ[str]):
    """os.environ's own class, noting reads of VARIABLES (its instance is unchanged)."""

    def __getitem__(self, key: str) -> str:
        if key in VARIABLES:
            frame: FrameType | None = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(_STDLIB):
                frame = frame.f_back  # os.getenv, Mapping.get, Mapping.__contains__
            if frame is not None:
                _reads.append((frame.f_code.co_filename, frame.f_lineno))
        return super().__getitem__(key)


_PLAIN = type(os.environ)


def start() -> None:
    """Note reads of VARIABLES from now on (os.environ stays the same object)."""
    os.environ.__class__ = _WatchedEnviron


def stop() -> None:
    os.environ.__class__ = _PLAIN


def suite_reads(root: Path) -> list[str]:
    """'file:line' of each read noted so far in code under `root` (not an installed
    package's), first read of each place only."""
    installed = {sysconfig.get_path(name) for name in ("purelib", "platlib")}
    found: dict[str, None] = {}
    for filename, line in _reads:
        path = Path(filename)
        if not path.is_relative_to(root) or any(path.is_relative_to(p) for p in installed if p):
            continue
        found.setdefault(f"{path.relative_to(root)}:{line}", None)
    return list(found)
