"""Phase 5 (`capsafe sweep --fix`), fixes: a verified patch for every verdict with a cause.

For each order-dependent test (verified polluters) and brittle test (verified state-setters)
the phase finds the victim's cleaners (harness.sweep.cleaners; order-dependent only), then
asks the fix engine (harness.fix.find_patch) for a patch, handing it the cause, the cleaners,
the environment variables the cause left changed, and `replay_in`: replays in a scratch copy
of the suite with the candidate applied (harness.sweep.host). What the engine returns it has
verified; the phase writes it into --out/fixes (harness.sweep.fix_files) with the command
that applies it, and journals each finished cleaner search and patch search, so --resume
does not redo them. The phase is opt-in and has its own --phase-budget: a sweep without
--fix runs exactly what it ran before. A patch the budget stopped is no claim: its verdict
stays what the evidence says, and a note counts what was left.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from ..report.summary import FixRecord
from ..verdicts import catalogue
from ..verdicts.catalogue import Verdict
from ..verdicts.evidence import VERIFY_TIMES
from .cleaners import CleanerSearch, find_cleaners
from .fix_files import FIXES_DIR, FixFile, PatchError, apply_diff, sha256, slug
from .host import Host
from .journal import Journal
from .store import EvidenceStore

if TYPE_CHECKING:  # the engine is imported when the phase runs: libcst is 2-3 s of start-up
    from ..fix import case as fix_case

FindPatch = Callable[..., "fix_case.VerifiedPatch | None"]
Kind = Literal["order-dependent", "brittle"]
Job = tuple[Kind, str]  # (kind, victim)
KINDS: dict[str, Kind] = {
    Verdict.ORDER_DEPENDENT: "order-dependent", Verdict.BRITTLE: "brittle",
}  # fmt: skip


class FixHost(Host, Protocol):
    """A host that can also replay in a scratch copy of the suite."""

    def replay_in(self, root: Path, sequence: Sequence[str]) -> dict[str, bool | None]: ...


class Fixes:
    """The fixing phase of one sweep, through its host, into its store and --out/fixes."""

    def __init__(
        self, host: FixHost, store: EvidenceStore, journal: Journal, rootdir: Callable[[], Path],
        out: Path, invoked_from: Path, find_patch: FindPatch | None = None,
    ) -> None:  # fmt: skip
        self.host = host
        self.store = store
        self.journal = journal
        self.rootdir = rootdir  # collection sets it: asked when the phase runs
        self.out = out
        self.invoked_from = invoked_from
        self.find_patch = find_patch  # None: the fix engine's, imported when it is asked
        self.fixes: dict[str, FixFile] = {}  # victim -> its verified patch
        self.records: dict[str, FixRecord] = {}

    def jobs(self) -> list[Job]:
        """(kind, victim) for every order-dependent and brittle verdict the evidence gives."""
        with self.store.lock:
            found = [(catalogue.classify(ev), n) for n, ev in sorted(self.store.evidence.items())]
        return [(KINDS[verdict], n) for verdict, n in found if verdict in KINDS]

    def run(self) -> None:
        jobs = self.jobs()
        leaks = self._leaks({c for _, n in jobs for c in self._causes(n)})
        self.host.pool("fixes", jobs, lambda job, _: self._fix(job, leaks))
        left = [n for _, n in jobs if n not in self.records]
        if left:
            self.host.note(f"--fix: {len(left)} verdict(s) got no patch search before the "
                           "budget ran out")  # fmt: skip

    def _causes(self, victim: str) -> list[str]:
        ev = self.store.ev(victim)
        return list(ev.polluters or ev.state_setters)

    def _leaks(self, causes: set[str]) -> dict[str, dict[str, tuple[str | None, str | None]]]:
        """Cause -> the environment variables it left changed, (before, after), from its rows."""
        found: dict[str, dict[str, tuple[str | None, str | None]]] = {}
        if not causes:
            return found
        for row in self.store.rows():
            if row["nodeid"] in causes and row.get("env_leak"):
                for var, values in (row.get("env_leak") or {}).items():
                    before, after = [*values, None, None][:2]
                    found.setdefault(row["nodeid"], {}).setdefault(var, (before, after))
        return found

    def _fix(self, job: Job, leaks: Mapping[str, Mapping[str, tuple[str | None, str | None]]]
             ) -> list[Job]:  # fmt: skip
        kind, victim = job
        causes = self._causes(victim)
        cleaners = self._cleaners(victim, causes) if kind == "order-dependent" else None
        if cleaners is not None and cleaners.budget_cut:
            return []
        env: dict[str, tuple[str | None, str | None]] = {}
        for cause in causes:
            env.update(leaks.get(cause, {}))
        found = tuple(cleaners.cleaners) if cleaners else ()
        from ..fix.case import FixCase  # here: only --fix pays libcst's import

        case = FixCase(victim, kind, tuple(causes), found, env,
                       collected=tuple(self.store.collected))  # fmt: skip
        fix, outcome = self._patch(case)
        if fix is None and outcome is None:
            return []  # the budget stopped it: no record, the note counts it
        with self.store.lock:
            if fix is not None:
                self.fixes[victim] = fix
            self.records[victim] = FixRecord(
                victim, kind, list(found), cleaners.replays + cleaners.verification_replays
                if cleaners else 0, fix is not None, fix.how if fix else str(outcome),
            )  # fmt: skip
        return []

    def _cleaners(self, victim: str, polluters: Sequence[str]) -> CleanerSearch:
        kept, data = self.journal.result("cleaners", victim)
        if kept and isinstance(data, dict):
            found = CleanerSearch.from_dict(data)
        else:
            seed = self.store.seeds[0] if self.store.seeds else None
            with self.store.lock:  # asked alone: in a group one would hide its cleaners
                known = list(dict.fromkeys(c for kind, causes in self.store.causes
                                           if kind == "polluter" for c in causes))  # fmt: skip
            found = find_cleaners(self.host, victim, polluters, self.store.collected,
                                  times=VERIFY_TIMES, seed=seed, alone=known)  # fmt: skip
            if not found.budget_cut:
                self.journal.add_result("cleaners", victim, found.to_dict())
        with self.store.lock:
            self.store.ev(victim).cleaners = list(found.cleaners)
        return found

    def _patch(self, case: fix_case.FixCase) -> tuple[FixFile | None, str | None]:
        """(the verified patch, None) or (None, why there is none); (None, None) when the
        budget ran out before the engine decided."""
        kept, data = self.journal.result("fix", case.victim)
        if kept and isinstance(data, dict):
            fix = FixFile(**data["fix"]) if data.get("fix") else None
            if fix is not None:
                fix.write(self.out / FIXES_DIR)
            return fix, None if fix else str(data.get("outcome", ""))
        rootdir = self.rootdir()
        if self.find_patch is None:
            from ..fix.case import find_patch  # here, as FixCase above

            self.find_patch = find_patch
        try:
            patch = self.find_patch(case, rootdir, self.host.replay_in, times=VERIFY_TIMES,
                                    budget_left=self.host.budget_left)  # fmt: skip
        except Exception as exc:  # an engine bug costs this verdict its patch, not the report
            self.host.note(f"--fix: the fix engine failed on {case.victim}: "
                           f"{type(exc).__name__}: {exc}")  # fmt: skip
            return None, "the fix engine failed (see the notes)"
        if patch is None and not self.host.budget_left():
            return None, None
        fix, outcome = (None, "no patch verified") if patch is None else self._file(case, patch)
        self.journal.add_result(
            "fix", case.victim, {"fix": asdict(fix) if fix else None, "outcome": outcome}
        )
        return fix, outcome

    def _file(self, case: fix_case.FixCase, patch: fix_case.VerifiedPatch
              ) -> tuple[FixFile | None, str]:  # fmt: skip
        """The patch as fixes/<slug>.json and .patch, checked against the file as it is now."""
        rootdir = self.rootdir()
        target = rootdir / patch.path
        try:
            data = target.read_bytes()
            after = apply_diff(data.decode("utf-8"), patch.diff).encode("utf-8")
        except (OSError, UnicodeDecodeError, PatchError) as exc:
            self.host.note(f"--fix: the patch for {case.victim} does not apply to {target}: {exc}")
            return None, "its patch does not apply to the file (see the notes)"
        if sha256(data) != patch.sha256_before:
            self.host.note(f"--fix: {target} changed during the sweep: no patch for "
                           f"{case.victim}")  # fmt: skip
            return None, f"{patch.path} changed during the sweep"
        fix = FixFile(
            victim=case.victim, kind=case.kind, rootdir=str(rootdir), path=patch.path,
            sha256_before=patch.sha256_before, sha256_after=sha256(after), diff=patch.diff,
            source=patch.source, how=patch.how, apply=self.apply_command(case.victim),
            causes=list(case.causes), cleaners=list(case.cleaners),
            evidence=dict(patch.evidence),
        )  # fmt: skip
        fix.write(self.out / FIXES_DIR)
        return fix, patch.how

    def apply_command(self, victim: str) -> str:
        """`capsafe fix OUT TEST`, OUT as the person who ran the sweep would type it."""
        try:
            out = str(self.out.relative_to(self.invoked_from))
        except ValueError:
            out = str(self.out)
        return shlex.join(["capsafe", "fix", out, victim])

    def verdict_fields(self, victim: str) -> dict[str, object] | None:
        """TestVerdict.fix for `victim`: what the report shows of its patch."""
        fix = self.fixes.get(victim)
        if fix is None:
            return None
        return {"path": fix.path, "diff": fix.diff, "how": fix.how, "source": fix.source,
                "patch": f"{FIXES_DIR}/{slug(victim)}.patch", "apply": fix.apply}  # fmt: skip
