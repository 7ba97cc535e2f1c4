"""What the sweep hands the fix engine and what it gets back (docs/fixes.md; the interface of
issue 25 between the sweep and the engine).

The engine runs no test itself: it calls `replay`, which the sweep provides, on a scratch copy
of the rootdir with a candidate patch applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ReplayIn = Callable[[Path, Sequence[str]], Mapping[str, bool | None]]
"""replay(root, sequence): run `sequence` (node ids relative to the suite's rootdir), in this
order, in ONE fresh pytest process whose rootdir is `root` (the real rootdir or a scratch copy of
it); returns node id -> failed? (None: it did not run). Provided by the sweep (Host.replay with a
`root=` argument; a scratch root is never served by the fork server)."""


@dataclass(frozen=True)
class FixCase:
    """One verdict to fix: the victim, what causes it, and what the sweep knows about it."""

    victim: str  # node id
    kind: Literal["order-dependent", "brittle"]
    # verified polluters (order-dependent) or state-setters (brittle), in run order
    causes: tuple[str, ...]
    cleaners: tuple[str, ...] = ()  # verified cleaners (order-dependent only), best first
    env_leaks: Mapping[str, tuple[str | None, str | None]] = field(default_factory=dict)
    # variable -> (before, after) that a cause left changed (records' env_leak)


@dataclass(frozen=True)
class VerifiedPatch:
    """A unified diff that replay showed fixes `victim` (never built for one that did not)."""

    victim: str
    path: str  # file the diff changes, relative to the rootdir
    sha256_before: str  # of that file when the sweep read it (`capsafe fix` refuses if it changed)
    diff: str  # unified diff, a/ b/ paths relative to the rootdir
    source: Literal["idiom", "cleaner", "state-setter"]
    how: str  # one line for the report: what the patch does and where it came from
    evidence: Mapping[str, object]  # replays run and their outcomes (K passes each check)


def find_patch(
    case: FixCase,
    rootdir: Path,
    replay: ReplayIn,
    *,
    times: int,
    budget_left: Callable[[], bool],
) -> VerifiedPatch | None:
    """The best verified patch for `case`, or None when none verified within the budget.

    The engine's strategies land in the next commits (docs/fixes.md); until then no case gets
    a patch, which is what the sweep must handle anyway (a patch that does not verify is never
    returned).
    """
    del case, rootdir, replay, times, budget_left
    return None
