"""Cleaners: the tests that, run between a victim's polluter and the victim, make it pass.

For an order-dependent victim V with a verified polluter sequence P, a cleaner C is a test
with `P C V` passing (K times, no other process alive) while `P V` fails (the search verified
that K times already). iFixFlakies and iPFlakies find them to turn a cleaner's statements
into a patch; the fix engine (harness.fix) does the same with what this module finds.

Group testing over the suite's other tests: one replay `P G V` per group G (a few dozen
tests, a module's together, the victim's and the polluters' modules first). A group that
lets V pass holds a cleaner, unless what cleans is several tests together: bisection
(harness.fix.delta) finds the one, which must clean alone, else capped ddmin splits the
group down to a single cleaner or gives the group up. A found cleaner is verified K times,
then taken out of its group and the rest asked again, up to `cap` cleaners. A group whose
member re-pollutes after a cleaner hides that cleaner, so the tests known to pollute are
asked one at a time instead (a test that sets a mode pollutes the tests expecting the other
and may clean this victim); an unknown re-polluter still hides one: the search lists what it
verified, never claims there is no other. Every replay goes through the sweep's `Host`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..fix.delta import bisect, capped_ddmin
from ..plugin.order import module_of
from .host import BudgetSpent, Host

CLEANERS_CAP = 3  # cleaners verified per victim before the search stops
GROUP_SIZE = 50  # tests one group replay puts between the polluter and the victim
SPLIT_CAP = 12  # ddmin replays spent on a group whose bisection ended on a non-cleaner


@dataclass(frozen=True)
class CleanerSearch:
    """What one cleaner search found: verified cleaners, best (first found) first."""

    victim: str
    candidates: int
    cleaners: tuple[str, ...]
    replays: int  # group and split replays
    verification_replays: int
    budget_cut: bool = False  # the budget ran out before the search finished

    def to_dict(self) -> dict[str, object]:
        return {"victim": self.victim, "candidates": self.candidates,
                "cleaners": list(self.cleaners), "replays": self.replays,
                "verification_replays": self.verification_replays,
                "budget_cut": self.budget_cut}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> CleanerSearch:
        cleaners = data.get("cleaners", [])
        return cls(
            str(data["victim"]), int(str(data.get("candidates", 0))),
            tuple(str(c) for c in cleaners) if isinstance(cleaners, list) else (),
            int(str(data.get("replays", 0))), int(str(data.get("verification_replays", 0))),
            bool(data.get("budget_cut", False)),
        )  # fmt: skip


def groups(candidates: Sequence[str], near: Sequence[str], size: int) -> list[list[str]]:
    """`candidates` in groups of at most `size`, each module's tests together (as in the
    project's order, so module fixtures live as they do there), modules of `near` (the
    victim's and the polluters') first: a test that cleans shared state is most often
    beside the test that reads or writes it."""
    modules: dict[str, list[str]] = {}
    for nodeid in candidates:
        modules.setdefault(module_of(nodeid), []).append(nodeid)
    first = [module_of(n) for n in near]
    ordered = sorted(modules, key=lambda m: first.index(m) if m in first else len(first))
    flat = [n for m in ordered for n in modules[m]]
    return [flat[k : k + size] for k in range(0, len(flat), size)]


class _Search:
    """One victim's cleaner search: the replays it asks, counted."""

    def __init__(self, host: Host, victim: str, polluters: Sequence[str], seed: int | None):
        self.host, self.victim, self.polluters, self.seed = host, victim, list(polluters), seed
        self.answers: dict[tuple[str, ...], bool] = {}
        self.verification = 0

    def cleans(self, between: Sequence[str], *, exclusive: bool = False) -> bool:
        """Does the victim pass with `between` run after its polluters, in one process?"""
        key = tuple(between)
        if not exclusive and key in self.answers:
            return self.answers[key]
        if not self.host.budget_left():
            raise BudgetSpent
        done = self.host.replay([*self.polluters, *between, self.victim], seed=self.seed,
                                kind="verify-cleaner" if exclusive else "cleaner",
                                exclusive=exclusive)  # fmt: skip
        passed = done.outcome(self.victim)[0] is False
        if exclusive:
            self.verification += 1
        else:
            self.answers[key] = passed
        return passed

    def one(self, group: list[str]) -> str | None:
        """The one cleaner in a group that cleans, or None when no single test of it does."""
        found = bisect(group, self.cleans)
        if self.cleans([found]):
            return found
        smallest, _ = capped_ddmin(group, self.cleans, SPLIT_CAP)
        return smallest[0] if len(smallest) == 1 and self.cleans(smallest) else None

    def verified(self, cleaner: str, times: int) -> bool:
        return all(self.cleans([cleaner], exclusive=True) for _ in range(times))


def find_cleaners(
    host: Host,
    victim: str,
    polluters: Sequence[str],
    candidates: Sequence[str],
    *,
    times: int,
    seed: int | None = None,
    cap: int = CLEANERS_CAP,
    size: int = GROUP_SIZE,
    alone: Sequence[str] = (),
) -> CleanerSearch:
    """The verified cleaners of `victim` after `polluters` among `candidates` (up to `cap`);
    BudgetSpent never escapes: a search the budget stops says so (`budget_cut`). The
    candidates in `alone` (known polluters of other tests: in a group, one would re-pollute
    after a cleaner and hide it, yet it may itself clean this victim) are asked one at a
    time, first."""
    pool = [c for c in dict.fromkeys(candidates) if c != victim and c not in polluters]
    singles = [c for c in pool if c in set(alone)]
    pool = [c for c in pool if c not in set(singles)]
    search = _Search(host, victim, polluters, seed)
    found: list[str] = []
    cut = False
    try:
        for group in [[c] for c in singles] + groups(pool, [victim, *polluters], size):
            rest = list(group)
            while rest and len(found) < cap and search.cleans(rest):
                cleaner = search.one(rest)
                if cleaner is None:
                    break  # only tests together clean: none of them is a cleaner
                if search.verified(cleaner, times):
                    found.append(cleaner)
                rest.remove(cleaner)
            if len(found) >= cap:
                break
    except BudgetSpent:
        cut = True
    return CleanerSearch(victim, len(pool), tuple(found), len(search.answers),
                         search.verification, cut)  # fmt: skip
