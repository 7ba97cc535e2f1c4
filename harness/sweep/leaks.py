"""The cause of a leak victim: the test that left a capture open before it in its process.

A test that began no capture and failed with a capture error ran into a capture another
test of its process left open (issue 20: CuPy's memory-pool tests after a graph test whose
capture a neighbour broke). The suite runs' records say which tests ended with a capture
still open, so the candidates are known without a search. But a capture is left open only
when a neighbour thread broke it, which a replay repeats by chance: a replay of `L V`
counts only when L left its capture open again. VERIFY_TIMES such replays in which V
failed with a capture error confirm L; one in which V passed refutes it; replays in which
L's capture ended, or V failed otherwise, say nothing, and at most TRIES_PER_CANDIDATE are
spent on a candidate.
A bisection would read a chance event as an answer, so none runs for a leak victim.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..verdicts import fold
from ..verdicts.evidence import VERIFY_TIMES
from .host import BudgetSpent, Host

TRIES_PER_CANDIDATE = 3 * VERIFY_TIMES  # replays of `L V`, most of them wasted when L's
# capture survives its neighbours
MAX_CANDIDATES = 3  # leakers tried per victim, the one nearest before it first


def candidates(every: Mapping[tuple[str, str], fold.Attempt], victim: str) -> list[str]:
    """Tests that ended with a capture open before `victim` in a process where it failed
    with a capture error, the nearest first, each once (a capture left open stays open for
    the rest of the process, so the one nearest before it is the likeliest, not the only
    one)."""
    found: dict[str, None] = {}
    failing = sorted(
        (a for a in every.values() if a.nodeid == victim and a.leak_victim),
        key=lambda a: (a.run_id, a.worker),
    )
    for attempt in failing:
        same = [
            a
            for a in every.values()
            if a.run_id == attempt.run_id and a.worker == attempt.worker
            and a.pid == attempt.pid and a.index < attempt.index and a.left_open
        ]  # fmt: skip
        for a in sorted(same, key=lambda a: -a.index):
            found.setdefault(a.nodeid)
    return list(found)[:MAX_CANDIDATES]


def confirm(host: Host, leaker: str, victim: str, seed: int | None) -> tuple[bool, int]:
    """(did `leaker V` confirm VERIFY_TIMES times, refuted never?, replays spent)."""
    confirmed = spent = 0
    while confirmed < VERIFY_TIMES and spent < TRIES_PER_CANDIDATE:
        if not host.budget_left():
            raise BudgetSpent
        spent += 1
        done = host.replay([leaker, victim], seed=seed, kind="verify")
        left = done.attempts.get(leaker)
        if left is None or not left.left_open:
            continue  # its capture survived (or it did not run): this replay says nothing
        mine = done.attempts.get(victim)
        if mine is not None and not mine.failed:
            return False, spent  # the capture was open and the victim did not run into it
        confirmed += mine is not None and mine.leak_victim
    return confirmed >= VERIFY_TIMES, spent
