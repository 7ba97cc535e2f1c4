"""Concurrency first: which failing tests are `parallel-unsafe`, and whom each collides with.

A suite whose xdist workers share a directory fails in collisions, and a polluter search
over such a failure bisects an order that is not its cause (issue 24: 44 searches, two
at the ddmin cap, 93 tests left flaky). So before any order search, this phase decides
from the run records which failures happened only while another worker ran (each
attempt's window counted from its first phase's own start: a collision during setup
counts), and replays the order each of those tests failed in, in one process with no
other process alive, K times (and each of its failing orders at least once): a test that
passes them all is parallel-unsafe and never goes to a polluter search. The replays are
batched: one replay of a worker's whole sequence decides every suspect that failed in it.

Then pair runs narrow its partner by group testing over the tests that overlapped it
(issue 21): the test in one process and a group of candidates in another, started
together with no other process of the sweep alive. A collision of a few milliseconds
needs time to happen, so the group's side repeats its tests for about PAIR_WINDOW_S (as
the suite runs timed them) and the test's side repeats the test COVER times as long (as
its repetitions timed it in one process with nothing beside it, one process for all such
tests), stopping at its first failure. Each repetition sets its module up and tears it
down (harness/plugin/repeats.py): a collision of one module's teardown with another's
setup (python-fs) needs both every time. A test that fails repeated so (python-fs's
test_addpath imports a module it first expects not importable) is timed again with each
repetition in a forked child (harness/plugin/forked.py) and repeated so in its pair runs;
one that fails that way too is run once. A pair
run whose test side was over while the group's still ran (a loaded machine) is run
again, longer (`_PairRuns`): its pass said nothing. The likeliest candidate is tried
alone first; a group beside which it fails is halved, the half that keeps it failing
kept; a single candidate is named the one it collides with once it made it fail K times
of K. The search stops there, or when no candidate is left, or after MAX_PAIR_RUNS pair
runs for that test (the phase's own bound: no per-phase budget option exists yet).
"""

from __future__ import annotations

import concurrent.futures
import math
import statistics
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..verdicts import fold
from ..verdicts.evidence import VERIFY_TIMES
from .host import Host
from .options import SweepOptions
from .store import EvidenceStore

MAX_CANDIDATES = 16  # tests a pair search narrows over, most overlapping first
MAX_PAIR_RUNS = 12  # pair runs (two processes each) one parallel-unsafe test may spend
PAIR_WINDOW_S = 0.2  # how long the candidates' side of a pair run keeps repeating them
MAX_REPEATS = 100  # at most so many rounds of the candidates in one pair run
COVER = 1.5  # the test's side lasts this many times the candidates' (as the runs timed them)
MAX_VICTIM_REPEATS = 300  # at most so many repetitions of the test in one pair run
TIMING_REPEATS = 5  # repetitions of each test in the one process that times them
RERUNS = 2  # pair runs again when the test's side was not beside the group's to its end
COVERED = 0.9  # "beside to the end": beside at least this share of the group's side

FIRST_FAILURE = ("-x",)  # the test's side stops at its first failure: that decides the pair run
FORKED = ("--capsafe-forked",)  # each repetition in a forked child (harness/plugin/forked.py)
ProcessKey = tuple[str, str, int]  # (run id, worker, pid): one suite-run process


def _process(attempt: fold.Attempt) -> ProcessKey:
    return attempt.run_id, attempt.worker, attempt.pid


class ParallelCheck:
    """The parallel-unsafe phase of one sweep, through its host, into its store."""

    def __init__(self, options: SweepOptions, host: Host, store: EvidenceStore) -> None:
        self.options = options
        self.host = host
        self.store = store
        self._checked: set[str] = set()  # tests this phase decided on (either way)
        self._ran = False
        self.collided = False  # a test was found parallel-unsafe
        self._per_repetition: dict[str, float] = {}  # seconds, for tests that repeat cleanly
        self._forked: set[str] = set()  # of those, the ones that repeat only in forked children

    # -- which failures are collisions -----------------------------------------------
    def suspects(self) -> list[str]:
        """Tests that failed in the suite runs, never alone and never in a capture of their
        own, each of whose failing attempts overlapped a test of another worker."""
        if self.options.workers < 2:
            return []
        every = self.store.run_attempts
        failing: dict[str, list[fold.Attempt]] = {}
        for attempt in every.values():
            if attempt.failed:
                failing.setdefault(attempt.nodeid, []).append(attempt)
        found = []
        for nodeid, fails in sorted(failing.items()):
            ev = self.store.ev(nodeid)
            if ev.ever_failed_alone or not ev.isolation_runs or ev.capture.suspect:
                continue
            if ev.leak_victim:  # a capture left open in its own process: not a collision
                continue
            if all(fold.concurrent_with(every, a) for a in fails):
                found.append(nodeid)
        return found

    def run(self) -> None:
        """Decide every suspect (sequence replays), then find each parallel-unsafe test's
        partner (pair runs); note it at the top when most failures are collisions."""
        self._ran = True
        suspects = [n for n in self.suspects() if n not in self._checked]
        self._checked.update(suspects)
        if not suspects:
            return
        replays = self._sequence_jobs(suspects)
        passed: Counter[str] = Counter()
        failed: set[str] = set()

        one_at_a_time = threading.Lock()  # the replays are exclusive anyway: holding this
        # over the choice too lets each see what the last decided (two pool threads both
        # chose before either replayed, and a victim its first order decided ran it twice)

        def sequence(job: tuple[ProcessKey, tuple[str, ...]], _: int) -> list[object]:
            key, targets = job
            with one_at_a_time:
                with self.store.lock:  # one that failed its order once is decided
                    targets = tuple(n for n in targets if n not in failed)
                if not targets or not self.host.budget_left():
                    return []
                order = self._sequence_of(key)
                order = order[: max(order.index(n) for n in targets) + 1]  # nothing after them
                ran = self.host.replay(order, seed=self._seed_of(key), kind="sequence",
                                       exclusive=True)  # fmt: skip
                with self.store.lock:
                    for nodeid in targets:
                        if ran.outcome(nodeid)[0] is False:
                            passed[nodeid] += 1
                        else:
                            failed.add(nodeid)
            return []

        self.host.pool("parallel checks", replays, sequence, target=lambda job: None)
        unsafe = [n for n in suspects if n not in failed and passed[n] >= VERIFY_TIMES]
        for nodeid in unsafe:
            self._mark_unsafe(nodeid)
        self.collided |= bool(unsafe)
        self._time_repetitions(unsafe)
        self.host.pool("pair runs", unsafe, self._partner_job)
        self._note_collisions(len(unsafe))

    def check(self, nodeid: str) -> None:
        """The phase, for a search that meets `nodeid` when the phase has not run (a sweep
        runs it before the searches, so this is then nothing)."""
        if not self._ran and nodeid not in self._checked:
            self.run()

    # -- the sequence replays ---------------------------------------------------------
    def _sequence_jobs(self, suspects: Sequence[str]) -> list[tuple[ProcessKey, tuple[str, ...]]]:
        """(process, the suspects it decides) in K rounds: a suspect with n failing attempts
        gets max(K, n) replays, the k-th of the process of its (k mod n)-th failing attempt
        in round k mod K, so every order it failed in is replayed, and at least K times in
        all (python-fs's test_mkdir failed in 5 runs, once after its polluter: replaying 3
        of the 5 orders called it parallel-unsafe in one sweep and order-dependent in
        another); suspects failing in one process share its replay in a round."""
        every = self.store.run_attempts
        run_ids = self.store.run_ids
        rounds: list[dict[ProcessKey, list[str]]] = [{} for _ in range(VERIFY_TIMES)]
        for nodeid in suspects:
            fails = sorted((a for a in every.values() if a.nodeid == nodeid and a.failed),
                           key=lambda a: run_ids.index(a.run_id))  # fmt: skip
            for k in range(max(VERIFY_TIMES, len(fails))):
                key = _process(fails[k % len(fails)])
                rounds[k % VERIFY_TIMES].setdefault(key, []).append(nodeid)
        return [(key, tuple(tests)) for r in rounds for key, tests in r.items()]

    def _sequence_of(self, key: ProcessKey) -> list[str]:
        """Every test the suite-run process `key` ran, in its order."""
        mine = [a for a in self.store.run_attempts.values() if _process(a) == key]
        return [a.nodeid for a in sorted(mine, key=lambda a: a.index)]

    def _seed_of(self, key: ProcessKey) -> int | None:
        return next((a.seed for a in self.store.run_attempts.values() if _process(a) == key),
                    None)  # fmt: skip

    def _mark_unsafe(self, nodeid: str) -> None:
        """List the tests that ran beside its failures: those common to every failing run,
        else all of them."""
        every = self.store.run_attempts
        beside = [set(fold.concurrent_with(every, a)) for a in every.values()
                  if a.nodeid == nodeid and a.failed]  # fmt: skip
        common = set.intersection(*beside)
        with self.store.lock:
            self.store.ev(nodeid).concurrent = sorted(common or set.union(*beside))

    # -- the pair runs ------------------------------------------------------------------
    def candidates(self, nodeid: str) -> list[str]:
        """The tests that overlapped its failing attempts, most likely partner first: in
        the most failing attempts, then with the longest overlap."""
        every = self.store.run_attempts
        count: Counter[str] = Counter()
        overlap: Counter[str] = Counter()
        for victim in (a for a in every.values() if a.nodeid == nodeid and a.failed):
            for other in every.values():
                if (other.run_id == victim.run_id and other.worker != victim.worker
                        and other.nodeid != nodeid and other.start < victim.stop
                        and victim.start < other.stop):  # fmt: skip
                    count[other.nodeid] += 1
                    both = min(other.stop, victim.stop) - max(other.start, victim.start)
                    overlap[other.nodeid] += int(both * 1e6)
        ranked = sorted(count, key=lambda n: (-count[n], -overlap[n], n))
        return ranked[:MAX_CANDIDATES]

    def _partner_job(self, nodeid: str, _: int) -> list[object]:
        self._partner(nodeid)
        return []

    def _partner(self, nodeid: str) -> None:
        """Group testing over its candidates (`_narrow`). A test whose repetitions in one
        process named nobody is not tried again forked: the planted test_needs_no_xdist
        (tests/harness/sweep/test_sweep_evidence.py), which fails in any xdist worker and
        has no partner, then failed 3 of 3 beside the test next to it, a false partner."""
        pending = self.candidates(nodeid)
        if pending:
            self._narrow(nodeid, pending, _PairRuns(self, nodeid))

    def _narrow(self, nodeid: str, pending: list[str], pairs: _PairRuns) -> bool:
        """Until one candidate is confirmed K of K (True), none is left, or the pair runs
        are spent. The likeliest candidate is tried alone first (one pair run, where group
        testing would spend log2 n)."""
        pending = list(pending)
        group = pending[:1]
        while group and pairs.left():
            if not pairs.fails_beside(group):
                if len(group) == len(pending):
                    return False  # none of those left makes it fail: candidates exhausted
                pending = pending[len(group) :]
                group = pending
                continue
            hits = 1
            while len(group) > 1 and pairs.left():
                half, rest = group[: len(group) // 2], group[len(group) // 2 :]
                group, hits = (half, 1) if pairs.fails_beside(half) else (rest, 0)
            if len(group) > 1:
                return False
            partner = group[0]
            while hits < VERIFY_TIMES and pairs.left():
                if not pairs.fails_beside([partner]):
                    break
                hits += 1
            if hits >= VERIFY_TIMES:
                with self.store.lock:
                    self.store.ev(nodeid).collides_with = [partner]
                return True
            pending.remove(partner)
            group = pending
        return False

    def _duration(self, nodeid: str) -> float:
        """Its median time from setup's start to teardown's end in the suite runs."""
        spans = [a.stop - a.start for a in self.store.run_attempts.values()
                 if a.nodeid == nodeid and a.stop > a.start]  # fmt: skip
        return max(statistics.median(spans), 0.001) if spans else PAIR_WINDOW_S

    def _times(self, tests: Sequence[str]) -> int:
        """How many times a side runs `tests` so that it lasts about PAIR_WINDOW_S."""
        span = sum(self._duration(n) for n in tests)
        return max(1, min(MAX_REPEATS, math.ceil(PAIR_WINDOW_S / span)))

    def _time_repetitions(self, tests: Sequence[str]) -> None:
        """One process, with nothing beside it, repeats each test in turn, 2 to
        TIMING_REPEATS times (each repetition its module set up and torn down,
        harness/plugin/repeats.py): a test that passes every repetition gets its seconds
        per repetition; those that fail (then a failure of their repetitions beside a group
        would not be the group's doing) are timed again in one process that forks each
        repetition, and those that pass there are repeated forked in their pair runs; the
        rest are run once in their pair runs. A test the suite runs
        timed at PAIR_WINDOW_S or longer is timed too: there its time included waiting on
        the test it collided with, or a loaded machine (the shared_dir suite's victim,
        0.17 and 0.29 s in two loaded runs, takes 0.05 s alone), and untimed it ran once
        a pair run."""
        blocks = {n: min(TIMING_REPEATS, max(2, self._times([n]))) for n in tests}
        self._time_in(blocks, ())
        again = {n: times for n, times in blocks.items() if n not in self._per_repetition}
        if not self.options.neighbors:  # a forked child would have no neighbour threads
            self._forked.update(self._time_in(again, FORKED))

    def _time_in(self, blocks: dict[str, int], extra: Sequence[str]) -> list[str]:
        """One process repeats each test of `blocks` its number of times (with `extra`
        options); the tests that passed every repetition, each given its seconds per
        repetition."""
        if not blocks or not self.host.budget_left():
            return []
        order = [n for n, times in blocks.items() for _ in range(times)]
        done = self.host.replay(order, seed=self._first_seed(order[0]), kind="repeat",
                                extra=extra, exclusive=True)  # fmt: skip
        timed = []
        for nodeid, times in blocks.items():
            attempt = done.attempts.get(nodeid)
            if attempt is not None and not attempt.failed:
                self._per_repetition[nodeid] = max(attempt.stop - attempt.start, 1e-3) / times
                timed.append(nodeid)
        return timed

    def _first_seed(self, nodeid: str) -> int | None:
        return next((a.seed for a in self.store.run_attempts.values()
                     if a.nodeid == nodeid and a.failed), None)  # fmt: skip

    def _beside(self, nodeid: str, group: Sequence[str], times: int) -> _PairRun:
        """One pair run: `nodeid` run `times` times in one process while `group` ran
        (repeated) in another, started together with no other process of the sweep alive."""
        seed = self._first_seed(nodeid)
        others = list(group) * self._times(group)
        mine = [nodeid] * times
        with self.host.only() as token, concurrent.futures.ThreadPoolExecutor(1) as pair:
            other = pair.submit(self.host.replay, others, seed=seed, kind="beside", group=token)
            extra = FIRST_FAILURE + (FORKED if nodeid in self._forked else ())
            done = self.host.replay(mine, seed=seed, kind="beside", extra=extra, group=token)
            beside = other.result()
        return _PairRun(done.outcome(nodeid)[0] is True, _span(done.attempts.values()),
                        _span(beside.attempts.values()))  # fmt: skip

    # -- the report's first line ----------------------------------------------------------
    def _note_collisions(self, collisions: int) -> None:
        """A suite where most failing tests only collided says so first: its order search
        is better run without xdist."""
        failing = sum(1 for ev in self.store.evidence.values() if ev.failures)
        if collisions and 2 * collisions > failing:
            line = (f"{collisions} of {failing} failing tests failed only in collisions "
                    "between workers (parallel-unsafe: a sequential replay of the same order "
                    "passes); run the order search with `--workers 0`")  # fmt: skip
            with self.store.lock:
                self.store.notes.insert(0, line)


def _span(attempts: Iterable[fold.Attempt]) -> tuple[float, float] | None:
    """(first start, last stop) of a process's attempts; None when it ran none."""
    every = [a for a in attempts if a.stop > a.start]
    return (min(a.start for a in every), max(a.stop for a in every)) if every else None


class _PairRun(NamedTuple):
    """What one pair run showed: the test's outcome, and when each side ran."""

    failed: bool  # the test failed on its side
    mine: tuple[float, float] | None  # its side's first start and last stop
    theirs: tuple[float, float] | None  # the group's side's

    def beside_to_the_end(self) -> bool:
        """Its side ran beside (nearly) all of the group's: a pass then says no."""
        if self.mine is None or self.theirs is None:
            return True  # nothing to go by: taken at its word, as before
        both = min(self.mine[1], self.theirs[1]) - max(self.mine[0], self.theirs[0])
        return both >= COVERED * (self.theirs[1] - self.theirs[0])


class _PairRuns:
    """One parallel-unsafe test's pair runs: how many are left, and each one's answer.

    The test's side repeats it COVER times as long as the group's side lasts (as the
    suite runs timed the group, and its repetitions timed it). On a loaded machine the two
    processes do not keep that pace: a side starts late or crawls, and a test whose side
    ended while the group's still ran was not beside it for the rest. A pass in such a
    pair run proves nothing: it is run again (up to RERUNS times, each a pair run of the
    test's MAX_PAIR_RUNS), the test's side as long, at the pace it just ran, as the
    group's really was."""

    def __init__(self, check: ParallelCheck, nodeid: str) -> None:
        self.check = check
        self.nodeid = nodeid
        self.spent = 0
        self.repeat = check._per_repetition.get(nodeid)  # its seconds per repetition

    def left(self) -> bool:
        return self.spent < MAX_PAIR_RUNS and self.check.host.budget_left()

    def fails_beside(self, group: Sequence[str]) -> bool:
        """Did it fail beside `group`, in a pair run that kept it beside the group?"""
        check = self.check
        span = check._times(group) * sum(check._duration(n) for n in group)
        times = 1 if self.repeat is None else math.ceil(COVER * span / self.repeat)
        times = max(1, min(MAX_VICTIM_REPEATS, times))
        for _ in range(1 + RERUNS):
            if not self.left():
                return False
            self.spent += 1
            run = check._beside(self.nodeid, group, times)
            if run.failed or self.repeat is None or run.beside_to_the_end():
                return run.failed
            assert run.mine is not None and run.theirs is not None
            self.repeat = max(run.mine[1] - run.mine[0], 1e-3) / times  # its pace now
            needed = math.ceil(COVER * (run.theirs[1] - run.mine[0]) / self.repeat)
            times = max(1, min(MAX_VICTIM_REPEATS, max(times, needed)))
        return False
