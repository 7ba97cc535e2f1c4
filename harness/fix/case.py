"""What the sweep hands the fix engine and what it gets back (docs/fixes.md; the interface of
issue 25 between the sweep and the engine).

The engine runs no test itself: it calls `replay`, which the sweep provides, on a scratch copy
of the rootdir with a candidate patch applied.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import libcst as cst

from .delta import capped_ddmin
from .idioms import rewrite_brittle, rewrites
from .locate import Found, find, read, site_of
from .transplant import Unit, donation, implant
from .verify import Checker, OutOfBudget, Scratch

MAX_CLEANERS = 3
"""Cleaners tried per victim, best first (each costs a minimisation)."""
UNEDITABLE = (cst.ParserSyntaxError, cst.CSTValidationError, RecursionError)
"""What libcst raises on source it cannot parse or a node it cannot build."""
STATEMENT_CAP = 32
"""Replays one statement minimisation may spend before it keeps what it has."""

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
    collected: tuple[str, ...] = ()
    # every node id the sweep collected, in its order: the module checks replay a module's
    # tests by id (empty: the engine reads them off the source, and misses parametrized ones)


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


@dataclass(frozen=True)
class _Candidate:
    path: str
    source: str
    kind: Literal["idiom", "cleaner", "state-setter"]
    how: str
    evidence: Mapping[str, object]


def find_patch(
    case: FixCase,
    rootdir: Path,
    replay: ReplayIn,
    *,
    times: int,
    budget_left: Callable[[], bool],
) -> VerifiedPatch | None:
    """The best verified patch for `case`, or None when none verified within the budget.

    Order (docs/fixes.md): an idiomatic rewrite of a polluter (it fixes every victim of
    that polluter), then a cleaner's statements moved into the victim, best cleaner first;
    for a brittle test, its own deletions made tolerant, then its state-setters' statements
    moved into it. Nothing is written under `rootdir`:
    every candidate is tried in a scratch copy, and only one that passes every check of
    harness.fix.verify is returned.
    """
    rootdir = rootdir.resolve()
    victim = _found(rootdir, case.victim)
    if victim is None:
        return None
    with Scratch(rootdir) as scratch:
        checker = Checker(
            scratch, replay, budget_left,
            victim=case.victim, kind=case.kind, causes=case.causes, times=times,
            collected=case.collected, named=case.cleaners,
        )  # fmt: skip
        tried: list[str] = []
        notes: list[str] = []
        try:
            if checker.victim_passes():  # it does not misbehave here: nothing to verify against
                return None
            for candidate in _candidates(case, rootdir, victim, checker, notes):
                evidence = checker.verify(candidate.path, candidate.source)
                if evidence is None:
                    tried.append(candidate.how)
                    continue
                evidence = {**evidence, "tried_first": tried, "notes": notes}
                return _patch(case, rootdir, candidate, evidence, checker.replays)
        except OutOfBudget:
            return None
    return None


def _found(rootdir: Path, nodeid: str) -> Found | None:
    site = site_of(nodeid)
    try:
        _, module = read(rootdir, site.path)
    except (OSError, UnicodeDecodeError, cst.ParserSyntaxError):
        return None
    return find(module, site)


def _candidates(
    case: FixCase, rootdir: Path, victim: Found, checker: Checker, notes: list[str]
) -> Iterator[_Candidate]:
    """Candidate patches, best first, each still to be verified; what the polluters' source
    shows and no rewrite fixes (a file under a fixed path) goes to `notes`."""
    makers: list[Callable[[], list[_Candidate]]] = []
    if case.kind == "order-dependent":
        makers += [
            functools.partial(_idioms, c, rootdir, case.env_leaks, notes) for c in case.causes
        ]
        makers += [
            functools.partial(_moved, (c,), rootdir, victim, checker, "cleaner")
            for c in case.cleaners[:MAX_CLEANERS]
        ]
    else:
        makers.append(functools.partial(_brittle, case.victim, rootdir, victim))
        makers.append(
            functools.partial(_moved, case.causes, rootdir, victim, checker, "state-setter")
        )
    for make in makers:
        try:
            made = make()
        except UNEDITABLE:  # source libcst cannot rebuild as planned: no candidate from it
            continue
        yield from made


def _idioms(
    cause: str,
    rootdir: Path,
    env_leaks: Mapping[str, tuple[str | None, str | None]],
    notes: list[str],
) -> list[_Candidate]:
    polluter = _found(rootdir, cause)
    if polluter is None:
        return []
    found, noted = rewrites(cause, polluter, rootdir, env_leaks)
    notes += noted
    return [_Candidate(r.path, r.source, "idiom", r.how, {}) for r in found]


def _brittle(test: str, rootdir: Path, victim: Found) -> list[_Candidate]:
    found = rewrite_brittle(test, victim, rootdir)
    return [_Candidate(r.path, r.source, "idiom", r.how, {}) for r in found]


def _moved(
    ids: Sequence[str],
    rootdir: Path,
    victim: Found,
    checker: Checker,
    kind: Literal["cleaner", "state-setter"],
) -> list[_Candidate]:
    """The donors' statements, minimised, at the start of the victim; none when even all of
    them do not make it pass (or none can move)."""
    units: list[Unit] = []
    skipped: list[str] = []
    for donor_id in ids:
        donor = _found(rootdir, donor_id)
        if donor is None:
            skipped.append(f"{donor_id}: its code was not found")
            continue
        offered = donation(donor_id, donor, victim, rootdir)
        units += offered.units
        skipped += offered.skipped
    names = ", ".join(ids)
    comment = f"capsafe fix: taken from the {kind} {names}"

    def source(indices: Sequence[int]) -> str:
        return implant(victim, [units[i] for i in indices], comment).code

    def fixes(indices: Sequence[int]) -> bool:
        checker.scratch.write(victim.site.path, source(indices))
        try:
            return checker.victim_passes()
        finally:
            checker.scratch.restore()

    everything = list(range(len(units)))
    if not units or not fixes(everything):
        return []
    kept, capped = capped_ddmin(everything, fixes, STATEMENT_CAP)
    how = (
        f"the victim starts with {len(kept)} of the {len(units)} statement(s) of its {kind} "
        f"{names} (for this victim only)"
    )
    evidence = {"statements": len(units), "kept": len(kept), "capped": capped, "skipped": skipped}
    return [_Candidate(victim.site.path, source(kept), kind, how, evidence)]


def _patch(
    case: FixCase,
    rootdir: Path,
    candidate: _Candidate,
    checks: Mapping[str, object],
    replays: int,
) -> VerifiedPatch:
    before = (rootdir / candidate.path).read_bytes()
    diff = unified(candidate.path, before.decode("utf-8"), candidate.source)
    evidence = {**candidate.evidence, **checks, "replays": replays}
    return VerifiedPatch(
        victim=case.victim,
        path=candidate.path,
        sha256_before=hashlib.sha256(before).hexdigest(),
        diff=diff,
        source=candidate.kind,
        how=candidate.how,
        evidence=evidence,
    )


NO_NEWLINE = "\\ No newline at end of file"


def unified(path: str, before: str, after: str) -> str:
    """The unified diff from `before` to `after` of `path` (a/ and b/ prefixes, as git and
    `patch -p1` read them), with git's marker after a last line that has no newline."""
    out: list[str] = []
    for line in difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
    ):
        out.append(line if line.endswith("\n") else f"{line}\n{NO_NEWLINE}\n")
    return "".join(out)
