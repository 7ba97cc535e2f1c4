"""The parallel check of the search phase: is a failing test `parallel-unsafe`?

A test that failed only beside other workers, and whose worker's sequence replayed in
one process with no other process alive passes K times, failed because of what ran at
the same time elsewhere. Each of the tests that overlapped it most is then started in
its own process beside the test alone, with nothing else alive: one that makes it fail
K times of K is the one it collides with.
"""

from __future__ import annotations

import concurrent.futures
from collections import Counter

from ..verdicts import fold
from ..verdicts.evidence import VERIFY_TIMES
from .host import Host
from .options import SweepOptions
from .store import EvidenceStore

MAX_BESIDE = 4  # concurrent tests a parallel-unsafe test is run beside, most overlapping first


class ParallelCheck:
    """The parallel-unsafe check of one sweep, through its host, into its store."""

    def __init__(self, options: SweepOptions, host: Host, store: EvidenceStore) -> None:
        self.options = options
        self.host = host
        self.store = store

    def check(self, nodeid: str) -> None:
        """parallel-unsafe: it failed only beside other workers, and its worker's sequence
        replayed in one process with no other process alive passes K times."""
        every = self.store.run_attempts
        fails = [a for a in every.values() if a.nodeid == nodeid and a.failed]
        beside = [(a, fold.concurrent_with(every, a)) for a in fails]
        if self.options.workers < 2 or not fails or not all(others for _, others in beside):
            return
        ev = self.store.ev(nodeid)
        if ev.ever_failed_alone:
            return
        first = fails[0]
        sequence = [*fold.process_sequence(every, first), nodeid]
        for _ in range(VERIFY_TIMES):
            if not self.host.budget_left():
                return
            done = self.host.replay(sequence, seed=first.seed, kind="sequence", exclusive=True)
            failed, _ = done.outcome(nodeid)
            if failed is not False:
                return
        common = set.intersection(*(set(others) for _, others in beside))
        with self.store.lock:
            ev.concurrent = sorted(common) or sorted({n for _, o in beside for n in o})
        overlaps = Counter(n for _, others in beside for n in others)
        candidates = sorted(ev.concurrent, key=lambda n: -overlaps[n])[:MAX_BESIDE]
        partner = self._collision(nodeid, first.seed, candidates)
        if partner is not None:
            with self.store.lock:
                ev.collides_with = [partner]

    def _collision(self, nodeid: str, seed: int | None, candidates: list[str]) -> str | None:
        """The candidate that, started in its own process together with `nodeid` alone,
        makes it fail K times of K (one pair run screens a candidate); None if none does."""
        for partner in candidates:
            failed = 0
            while failed < VERIFY_TIMES and self.host.budget_left():
                if self._beside(nodeid, partner, seed) is not True:
                    break
                failed += 1
            if failed == VERIFY_TIMES:
                return partner
        return None

    def _beside(self, nodeid: str, partner: str, seed: int | None) -> bool | None:
        """Did `nodeid` fail, run alone in one process while `partner` ran in another, and
        no other process of the sweep ran?"""
        with self.host.only() as group, concurrent.futures.ThreadPoolExecutor(1) as pair:
            other = pair.submit(self.host.replay, [partner], seed=seed, kind="beside", group=group)
            done = self.host.replay([nodeid], seed=seed, kind="beside", group=group)
            other.result()
        return done.outcome(nodeid)[0]
