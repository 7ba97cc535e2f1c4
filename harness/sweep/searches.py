"""Phase 3, searches: the cause of every failure that isolation did not explain.

For a test that fails in the suite but never alone, replay what ran before it to find
the polluter; for one that fails alone but passes in the suite, the state-setter
(harness.sweep.search holds the bisection and ddmin). A cause counts only once verified
VERIFY_TIMES times each way; a verified cause is then tried on the victim's module
siblings and on every failing test: replayed directly before every other test (the pair
screen, whole modules in their own order a process), and each hit gets a trial; a
polluter that fails when repeated is screened against whole modules instead, one replay
each. A victim no polluter explains goes to the parallel check (harness.sweep.parallel).
Every process goes through the sweep's `Host`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..plugin import order
from ..records import Signal
from ..report.summary import SearchRecord
from ..verdicts import fold
from ..verdicts.evidence import VERIFY_TIMES
from . import leaks, search
from .capture_sweep import CapturePhases
from .host import BudgetSpent, Host
from .isolation import Isolation
from .parallel import ParallelCheck
from .store import EvidenceStore

MAX_PREFIXES = 2  # failing (or passing) runs whose prefix a search tries before widening
PAIRS_PER_REPLAY = 100  # tests one pair screen (`P X1 P X2 ...`) puts after a cause, in
# whole modules (a module larger than this is one process)
MAX_LEAKERS = 10  # tests that left the environment changed, each screened as a polluter
UNFIT_SENTINEL = frozenset({Signal.CRASH, Signal.TIMEOUT})
"""A victim that failed so is no sentinel: one ending each block would wait out the timeout,
or end the process, at every block."""
SENTINEL_EVERY = 100  # tests a polluter's pair screen runs after one replay of it, before the
# victim that says its state outlived them (`P X1 ... X100 V P X101 ...`): the victim's
# failure costs pytest 6-8 ms of traceback formatting, ten trivial tests' time

Job = tuple[str, ...]
"""(kind, test), ("trial", kind, culprits..., test), ("screen", kind, culprits..., module)
or ("pairs", kind, culprits..., part): part "" plans a cause's pair screen and runs its
first process, part "k" its k-th, part "sK" the K-th block its sentinel did not vouch for,
one pair at a time."""


def explained_test(job: Job) -> str | None:
    """The test a search job would explain (None for a screen)."""
    return None if job[0] in ("screen", "pairs") else job[-1]


class Searches:
    """The cause searches of one sweep, through its host, into its store."""

    def __init__(
        self, host: Host, store: EvidenceStore, capture: CapturePhases, isolation: Isolation,
        parallel: ParallelCheck,
    ) -> None:  # fmt: skip
        self.host = host
        self.store = store
        self.capture = capture
        self.isolation = isolation  # its alone reruns count towards a verification
        self.parallel = parallel
        self._busy: set[str] = set()  # tests a search or trial is explaining right now
        self._tried: set[tuple[str, ...]] = set()  # (culprits..., test) trials already run
        self._sibling_trials: set[tuple[str, ...]] = set()  # (module, cause...) screened
        self._screen_prefixes: dict[str, tuple[int | None, list[str]]] = {}  # what a screen ran
        self._screen_searched: set[str] = set()  # tests searched from their screen's prefix
        self._pair_plans: dict[tuple[str, ...], tuple[list[list[str]], set[str]]] = {}
        self._sentinels: dict[tuple[str, ...], str] = {}  # a polluter -> its verified victim
        self._unvouched: dict[tuple[str, ...], list[list[str]]] = {}  # blocks to pair again
        self._pairs_only: set[tuple[str, ...]] = set()  # causes screened in pairs only: a
        # block of their first process held a cleaner
        self._unrepeatable: set[tuple[str, ...]] = set()  # causes that failed when repeated
        self._lock = store.lock  # one lock over the evidence and what the searches hold

    def jobs(self) -> list[Job]:
        """(kind, test) for every test whose verdict needs a cause search."""
        jobs: list[Job] = []
        for nodeid, ev in sorted(self.store.evidence.items()):
            if not ev.isolation_runs or self.capture.capture_unsafe(nodeid):
                continue
            if ev.failures and (not ev.ever_failed_alone
                                or ev.failed_alone_only_beside_neighbours):  # fmt: skip
                jobs.append(("polluter", nodeid))
            elif ev.always_failed_alone:  # failed in a suite run, or only alone (brittle)
                jobs.append(("state-setter", nodeid))
        return jobs

    def run(self) -> None:
        self.host.pool("cause searches", [*self.jobs(), *self._leakers()], self._job,
                       target=explained_test)  # fmt: skip

    def _leakers(self) -> list[Job]:
        """A pair screen for each test that left an environment variable changed (its alone
        run watches every variable), at most MAX_LEAKERS: a polluter whose victims cleaners
        hide in every run has no failing victim to start a search from (issue 24: accessify's
        test_disabling_accessify, whose 12 victims failed in no run of some seeds)."""
        with self._lock:
            leakers = sorted(n for n, ev in self.store.evidence.items()
                             if Signal.ENV_LEAK in ev.signals and not ev.failures)  # fmt: skip
            if len(leakers) > MAX_LEAKERS:
                self.host.note(f"{len(leakers)} tests left the environment changed: the first "
                               f"{MAX_LEAKERS} were screened as polluters")  # fmt: skip
            leakers = leakers[:MAX_LEAKERS]
            for n in leakers:
                self._claim_modules("polluter", (n,))
        return [("pairs", "polluter", n, "") for n in leakers]

    def _job(self, job: Job, _: int) -> list[Job]:
        kind, nodeid = job[0], job[-1]
        if kind == "screen":
            return self._screen_module(job[1], tuple(job[2:-1]), nodeid)
        if kind == "pairs":
            return self._pairs(job[1], tuple(job[2:-1]), nodeid)
        if not self._claim(nodeid):
            return []
        try:
            if kind == "trial":
                return self._trial(job[1], tuple(job[2:-1]), nodeid)
            return self._search(kind, nodeid)
        finally:
            with self._lock:
                self._busy.discard(nodeid)

    def _claim(self, nodeid: str) -> bool:
        """Take `nodeid` to explain; False when it is explained already or being explained."""
        with self._lock:
            self.store.ev(nodeid)
            if nodeid in self._busy or self.store.explained(nodeid):
                return False
            self._busy.add(nodeid)
            return True

    def _replay(self, before: Sequence[str], target: str, seed: int | None, kind: str,
                *, exclusive: bool = False) -> bool | None:  # fmt: skip
        """Did `target` fail, run after `before` in one fresh process? None: it did not run."""
        done = self.host.replay([*before, target], seed=seed, kind=kind, exclusive=exclusive)
        return done.outcome(target)[0]

    def _oracle(self, nodeid: str, want_failed: bool, seed: int | None) -> search.Oracle:
        def oracle(tests: Sequence[str]) -> bool:
            if not self.host.budget_left():
                raise BudgetSpent
            return self._replay(tests, nodeid, seed, "replay") is want_failed

        return oracle

    def _search(self, kind: str, nodeid: str) -> list[Job]:
        """Try the prefixes most likely to hold the cause, stop at the first that reproduces
        and verifies; then try the cause on other tests (returned as trial jobs)."""
        want_failed = kind == "polluter"
        if want_failed and self.store.ev(nodeid).leak_victim:
            return self._leak(nodeid)
        tried: list[list[str]] = []
        replays, candidates, capped = 0, 0, False
        with self.store.lock:
            hints = [c for k, c in self.store.causes if k == kind]
        for seed, prefix in self._prefixes(nodeid, want_failed):
            if prefix in tried or not prefix:
                continue
            tried.append(prefix)
            try:
                result = search.search(
                    nodeid, prefix, self._oracle(nodeid, want_failed, seed), hints=hints
                )
            except BudgetSpent:
                self.host.note(f"budget spent during the {kind} search for {nodeid}")
                self.store.ev(nodeid).budget_cut = True
                break
            hints = []
            replays += result.replays
            candidates = max(candidates, result.candidates)
            capped |= result.capped
            if result.reproduced:
                verified, spent = self._verify(kind, result.culprits, nodeid, seed)
                self._record(SearchRecord(nodeid, kind, candidates, replays, spent,
                                          list(result.culprits), verified, capped))  # fmt: skip
                if verified:
                    return self._trials(kind, result.culprits, nodeid)
                with self.store.lock:
                    self.store.ev(nodeid).unconfirmed = list(result.culprits)
                break
        else:
            self._record(SearchRecord(nodeid, kind, candidates, replays, 0, [], False, capped))
        if capped:
            self.host.note(
                f"{nodeid}: the {kind} search stopped at its cap of {search.DDMIN_CAP} ddmin "
                "replays"
            )
        if want_failed:
            self.parallel.check(nodeid)
        return []

    def _leak(self, nodeid: str) -> list[Job]:
        """A leak victim's cause: the tests its suite runs saw leave a capture open before
        it, each confirmed by replays in which it left its capture open again
        (harness.sweep.leaks). Nothing else is searched: its failure is in its own process."""
        with self.store.lock:
            found = leaks.candidates(self.store.run_attempts, nodeid)
        seed, spent = self._first_seed(), 0
        for leaker in found:
            try:
                verified, replays = leaks.confirm(self.host, leaker, nodeid, seed)
            except BudgetSpent:
                self.host.note(f"budget spent confirming the capture {leaker} left open "
                               f"as the cause of {nodeid}")  # fmt: skip
                self.store.ev(nodeid).budget_cut = True
                break
            spent += replays
            if verified:
                with self.store.lock:
                    self.store.ev(nodeid).polluters = [leaker]
                    self.store.causes.append(("polluter", (leaker,)))
                self._record(SearchRecord(nodeid, "polluter", len(found), 0, spent, [leaker],
                                          True, False))  # fmt: skip
                return []
        with self.store.lock:
            self.store.ev(nodeid).unconfirmed = found
        self._record(SearchRecord(nodeid, "polluter", len(found), 0, spent, [], False, False))
        return []

    def _verify(
        self, kind: str, culprits: Sequence[str], nodeid: str, seed: int | None
    ) -> tuple[bool, int]:
        """(culprits reproduce K times with no other process alive, and the test alone does
        the opposite K times?, replays spent). Alone runs already done count towards K."""
        want_failed = kind == "polluter"
        spent = 0
        ev = self.store.ev(nodeid)
        for _ in range(VERIFY_TIMES):
            if not self.host.budget_left():
                ev.budget_cut = True
                return False, spent
            spent += 1
            if self._replay(culprits, nodeid, seed, "verify", exclusive=True) is not want_failed:
                return False, spent

        def alone_agrees() -> bool:  # a polluter's victim never fails alone, a brittle test always
            return not ev.ever_failed_alone if want_failed else ev.always_failed_alone

        while ev.isolation_runs < VERIFY_TIMES and alone_agrees():
            if not self.host.budget_left():
                ev.budget_cut = True
                return False, spent
            failed, signals, replays, _ = self.isolation.alone(nodeid, seed)
            spent += replays
            if failed is None:
                return False, spent
            with self.store.lock:
                ev.isolation_runs += 1
                ev.isolation_failures += failed
                ev.signals |= signals
        if not alone_agrees():
            return False, spent
        with self.store.lock:
            if want_failed:
                ev.polluters = list(culprits)
            else:
                ev.state_setters = list(culprits)
            self.store.causes.append((kind, tuple(culprits)))
        return True, spent

    def _trials(self, kind: str, culprits: Sequence[str], victim: str) -> list[Job]:
        """Jobs that try a verified cause on other tests: the cause replayed directly before
        each of them (`_pairs`: a cleaner never sits between), whole modules at a time in
        their own order, so a victim needing a third polluter from its own module shows
        there too; and a polluter's module mirrors. Cleaners hide victims from shuffled
        runs, and a test that never failed may be one."""
        if any(self.capture.capture_unsafe(c) for c in culprits):
            return []  # what it leaves depends on a neighbour breaking its capture, which a
            # screen would replay by chance: its other victims are those the runs show
        first = self._claim_modules(kind, culprits)
        pairs: list[Job] = [("pairs", kind, *culprits, "")] if first else []
        if kind != "polluter":
            return pairs
        with self._lock:
            if not UNFIT_SENTINEL & self.store.ev(victim).signals:
                self._sentinels.setdefault(tuple(culprits), victim)
        return [*pairs, *self._mirrors(culprits, victim)]

    def _claim_modules(self, kind: str, culprits: Sequence[str]) -> bool:
        """Mark the cause's pair screen, and for a polluter every module it covers, as
        taken (no module screen repeats what the pair screen runs: issue 21's cost); False
        when they were taken already."""
        modules = dict.fromkeys(order.module_of(n) for n in self.store.collected)
        with self._lock:
            first = ("", *culprits) not in self._sibling_trials
            self._sibling_trials.add(("", *culprits))
            if kind == "polluter":
                self._sibling_trials.update((m, *culprits) for m in modules)
        return first

    def _mirrors(self, culprits: Sequence[str], victim: str) -> list[Job]:
        """Trials of each polluter as a victim of the cause with it replaced by `victim`, when
        both lie in one module: the pair screen leaves a cause's own tests out, and tests of
        one module often do the same thing (freezegun's two test_utils tests each pollute
        with test_min_and_max, and each is the other's victim)."""
        module = order.module_of(victim)
        return [
            ("trial", "polluter", *(victim if c == culprit else c for c in culprits), culprit)
            for culprit in culprits
            if order.module_of(culprit) == module and victim not in culprits
            and not self.store.explained(culprit)
        ]  # fmt: skip

    def _pairs(self, kind: str, culprits: tuple[str, ...], part: str) -> list[Job]:
        """Trial jobs for the tests that did what the cause explains when replayed directly
        after it: one process runs `P X1 P X2 P X3 ...`, so no cleaner sits between the
        cause and any test, in whatever package it lies. A polluter's candidates are every
        unexplained test that never failed alone, a state-setter's the tests that always
        failed alone. Each process runs whole modules in their own order (PAIRS_PER_REPLAY
        tests or one module), with the module's explained tests too: every test also runs
        after the cause and its module's earlier tests, as a module screen would run it, so
        a victim needing a third polluter from its module is a hit, searched from what a
        module screen would have run before it (the search keeps a test's first run, and
        other modules' cleaners ran between). The first process says whether the cause
        repeats; the others then run beside each other on the pool. A cause that fails when
        repeated is not trusted to have acted again: a note says so, and the modules not
        covered get module screens (the cause once before a whole module) instead, as do
        those of a replay that stopped early.

        A polluter with a verified victim V runs blocks instead of pairs: `P X1 ... X100 V`,
        V the sentinel. V failing at the block's end says P's state outlived every test of
        the block, so none of them cleaned it before the next one ran: each ran after P as
        surely as in a pair, at about half the processes' test time. A block whose V passed
        (a cleaner in it, or a victim whose own teardown restores) is screened again one
        pair at a time ("sK"); and when one of the first process's blocks was, cleaners are
        common in the suite and the cause's other processes run pairs from the start. What
        a sentinel cannot vouch for (a victim missed, never a wrong cause): a cleaner of
        only the part of P's state that V does not read, a cleaner followed in the block
        by a test setting the same state again, or a V that fails on its own second run."""
        if part.startswith("s"):
            with self._lock:
                block = self._unvouched[culprits][int(part[1:])]
                _, targets = self._pair_plans[culprits]
            return self._pair_chunk(kind, culprits, block, targets, sentinel=None)
        with self._lock:
            sentinel = None if culprits in self._pairs_only else self._sentinels.get(culprits)
        if part == "":
            chunks, targets = self._pair_plan(kind, culprits)
            if not chunks or not self.host.budget_left():
                return []
            jobs = self._pair_chunk(kind, culprits, chunks[0], targets, sentinel)
            with self._lock:
                repeats = culprits not in self._unrepeatable
                if self._unvouched.get(culprits):  # cleaners are common here: a block
                    self._pairs_only.add(culprits)  # would cost its pairs too, most times
            if not repeats:
                return [*jobs, *self._module_screens(kind, culprits, chunks[1:])]
            return [*jobs, *(("pairs", kind, *culprits, str(k)) for k in range(1, len(chunks)))]
        with self._lock:
            chunks, targets = self._pair_plans[culprits]
        return self._pair_chunk(kind, culprits, chunks[int(part)], targets, sentinel)

    def _pair_plan(self, kind: str, culprits: tuple[str, ...]) -> tuple[list[list[str]], set[str]]:
        """(the pair screen's processes, each a run of whole modules; its targets), fixed
        when the screen starts: its processes run whatever was explained meanwhile."""
        with self._lock:
            if kind == "polluter":  # what ever failed alone may crash or stall the replay
                failed_alone = {n for n in self.store.collected
                                if self.store.ev(n).ever_failed_alone}  # fmt: skip
                tests = [n for n in self.store.collected if n not in {*culprits, *failed_alone}]
            else:
                tests = [n for n in self._failing(kind) if n not in culprits]
            targets = {n for n in tests if not self.store.explained(n)}
            chunks = [c for c in module_chunks(tests, PAIRS_PER_REPLAY) if targets & set(c)]
            self._pair_plans[culprits] = (chunks, targets)
        return chunks, targets

    def _pair_chunk(
        self, kind: str, culprits: tuple[str, ...], chunk: list[str], targets: set[str],
        sentinel: str | None,
    ) -> list[Job]:  # fmt: skip
        """One pair-screen process over `chunk` (in blocks before `sentinel`, where there is
        one): trials for its hits, module screens for what it did not cover, and the blocks
        the sentinel did not vouch for screened again pair by pair."""
        want_failed = kind == "polluter"
        size = SENTINEL_EVERY if sentinel is not None else 1
        blocks = [chunk[k : k + size] for k in range(0, len(chunk), size)]
        tail = (sentinel,) if sentinel is not None else ()
        sequence = [n for block in blocks for n in (*culprits, *block, *tail)]
        seed = self._first_seed()
        done = self.host.replay(sequence, seed=seed, kind="pairs")
        found = done.attempts
        if any(c in found and found[c].failed for c in culprits):
            with self._lock:
                first = culprits not in self._unrepeatable
                self._unrepeatable.add(culprits)
            if first:
                self.host.note(f"{' + '.join(culprits)} failed when replayed before each "
                               "test in turn: its other victims are searched module by "
                               "module")  # fmt: skip
            return self._module_screens(kind, culprits, [chunk])
        if sentinel is not None and sentinel in found and UNFIT_SENTINEL & found[sentinel].signals:
            with self._lock:  # it hung or crashed at a block's end: pairs from here on
                self._pairs_only.add(culprits)
                unvouched = self._unvouched.setdefault(culprits, [])
                unvouched.append(chunk)
                again: list[Job] = [("pairs", kind, *culprits, f"s{len(unvouched) - 1}")]
            return again
        hits = [n for n in chunk if n in targets and n in found
                and found[n].failed is want_failed]  # fmt: skip
        with self._lock:  # a search starts from what a module screen would have run
            for n in hits if want_failed else ():
                mine = order.module_of(n)
                before = [t for t in chunk[: chunk.index(n)] if order.module_of(t) == mine]
                self._screen_prefixes.setdefault(n, (seed, [*culprits, *before]))
        trials: list[Job] = [("trial", kind, *culprits, n) for n in hits]
        lost = [n for n in chunk if n not in found]
        again = self._unvouched_blocks(culprits, blocks, sentinel, done.runs_failed, lost)
        return [*trials, *self._module_screens(kind, culprits, [lost]), *again]

    def _unvouched_blocks(
        self, culprits: tuple[str, ...], blocks: list[list[str]], sentinel: str | None,
        runs_failed: Mapping[str, tuple[bool, ...]], lost: list[str],
    ) -> list[Job]:  # fmt: skip
        """Pair-by-pair jobs for the blocks whose sentinel run did not fail, or never came
        (a crash cut the block off: what it left unrun is the module screens' already). The
        sentinel's runs come in the order it ran; one of them may be its own, in its
        module's block, and is no block's end."""
        if sentinel is None:
            return []
        ends = [end for block in blocks for end in [*(False for n in block if n == sentinel), True]]
        ran = runs_failed.get(sentinel, ())
        vouched = [failed for failed, end in zip(ran, ends, strict=False) if end]
        vouched += [False] * (len(blocks) - len(vouched))
        gone = set(lost)
        jobs: list[Job] = []
        with self._lock:
            unvouched = self._unvouched.setdefault(culprits, [])
            for block, held in zip(blocks, vouched, strict=True):
                left = [n for n in block if n not in gone]
                if held or not left:
                    continue
                unvouched.append(left)
                jobs.append(("pairs", "polluter", *culprits, f"s{len(unvouched) - 1}"))
        return jobs

    @staticmethod
    def _module_screens(kind: str, culprits: tuple[str, ...], chunks: list[list[str]]) -> list[Job]:
        """Module screens of a polluter for the modules of `chunks`' tests."""
        if kind != "polluter":
            return []
        modules = dict.fromkeys(order.module_of(n) for chunk in chunks for n in chunk)
        return [("screen", kind, *culprits, m) for m in modules]

    def _failing(self, kind: str) -> list[str]:
        """Tests that failed in the suite and alone as a `kind` would explain: a polluter's
        victims never fail alone, a state-setter's always do."""
        with self.store.lock:
            return [
                n for n, ev in self.store.evidence.items()
                if ev.isolation_runs and ev.collect_error is None
                and (ev.always_failed_alone if kind == "state-setter"
                     else ev.failures and not ev.ever_failed_alone)
            ]  # fmt: skip

    def _screen_module(self, kind: str, culprits: tuple[str, ...], module: str) -> list[Job]:
        tests = [
            n for n in self.store.collected if order.module_of(n) == module and n not in culprits
        ]
        return self._screened(kind, culprits, tests)

    def _first_seed(self) -> int | None:
        return self.store.seeds[0] if self.store.seeds else None

    def _screened(self, kind: str, culprits: Sequence[str], tests: list[str]) -> list[Job]:
        """Trial jobs for the unexplained tests that, in one replay of the cause then all of
        `tests`, did what the cause explains: one replay screens a module, each trial
        verifies. Explained tests stay in the replay (one may be a victim's second
        polluter), and what ran before a target is kept: when the cause alone does not
        reproduce, the target's search starts from it."""
        targets = [n for n in tests if not self.store.explained(n)]
        if not targets or len(tests) < 2 or not self.host.budget_left():  # the trial screens
            return [("trial", kind, *culprits, n) for n in targets]
        seed = self._first_seed()
        sequence = [*culprits, *tests]
        found = self.host.replay(sequence, seed=seed, kind="screen").attempts
        want_failed = kind == "polluter"
        hit = [n for n in targets if n not in found or found[n].failed is want_failed]
        with self._lock:
            for n in hit:
                self._screen_prefixes.setdefault(n, (seed, sequence[: sequence.index(n)]))
        return [("trial", kind, *culprits, n) for n in hit]

    def _trial(self, kind: str, culprits: tuple[str, ...], nodeid: str) -> list[Job]:
        """One replay of a known cause before another test; verified like any search."""
        ev = self.store.ev(nodeid)
        with self._lock:
            if (*culprits, nodeid) in self._tried:
                return []
            self._tried.add((*culprits, nodeid))
        if kind == "polluter" and ev.ever_failed_alone:
            return []
        seed = self._first_seed()
        oracle = self._oracle(nodeid, kind == "polluter", seed)
        try:
            if len(culprits) == 1:
                reproduced, replays = oracle(culprits), 1
            else:  # another test's cause may hold more than this one needs: minimise it
                found = search.search(nodeid, culprits, oracle)
                reproduced, replays = found.reproduced, found.replays
                culprits = found.culprits if found.reproduced else culprits
        except BudgetSpent:
            return []
        verified, spent = self._verify(kind, culprits, nodeid, seed) if reproduced else (False, 0)
        if reproduced:
            self._record(SearchRecord(nodeid, "trial", len(culprits), replays, spent,
                                      list(culprits), verified, False))  # fmt: skip
        if verified:
            return self._trials(kind, culprits, nodeid)
        with self._lock:  # the screen reproduced it with more before it: search that
            searched = nodeid in self._screen_searched or nodeid not in self._screen_prefixes
            self._screen_searched.add(nodeid)
        if reproduced or searched:
            return []
        # At once, while this trial still holds the test: a search queued as a job of its
        # own was dropped when another cause's trial of the same test held it by then
        # (freezegun's test_uuid1_past, seed 1, left `pass`).
        return self._search(kind, nodeid)

    def _record(self, record: SearchRecord) -> None:
        with self.store.lock:
            self.store.searches.append(record)

    def _prefixes(self, nodeid: str, want_failed: bool) -> Iterable[tuple[int | None, list[str]]]:
        """(seed, candidates) to search, best first: the test's own process in runs where it
        did what we explain, then everything that ran before it in that run, then what
        precedes it in the project's own order, then every other test with modules (and
        classes) kept together and the test's module last, so module- and class-scoped
        fixtures live as in the project's own order."""
        every = self.store.run_attempts
        run_ids = self.store.run_ids
        collected = self.store.collected
        mine = [a for a in every.values() if a.nodeid == nodeid and a.failed is want_failed]
        mine.sort(key=lambda a: run_ids.index(a.run_id))
        with self._lock:
            screened = self._screen_prefixes.get(nodeid) if want_failed else None
        if not want_failed and not mine:
            # It passed in no suite run and fails alone every time (a test that needs a second
            # GPU): no order the sweep ran lets it pass. Only the project's own order, which
            # the sweep never ran, is replayed, once (issue 20).
            if nodeid in collected:
                yield None, list(collected[: collected.index(nodeid)])
            return
        if screened is not None:
            yield screened
        for attempt in mine[:MAX_PREFIXES]:
            yield attempt.seed, fold.process_sequence(every, attempt)
        for attempt in mine[:1]:
            yield attempt.seed, fold.run_sequence(every, attempt)
        if nodeid in collected:  # the project's own order
            yield None, list(collected[: collected.index(nodeid)])
        others = [n for n in collected if n != nodeid]
        yield self._first_seed(), search.grouped(others, order.module_of(nodeid))


def module_chunks(tests: Sequence[str], size: int) -> list[list[str]]:
    """`tests` in their order, cut into runs of whole modules of about `size` tests: a
    module is never split (what its earlier tests leave is part of what a later one sees),
    and one larger than `size` is a run of its own."""
    chunks: list[list[str]] = []
    current: list[str] = []
    by_module: dict[str, list[str]] = {}
    for n in tests:
        by_module.setdefault(order.module_of(n), []).append(n)
    for members in by_module.values():
        if current and len(current) + len(members) > size:
            chunks.append(current)
            current = []
        current += members
    if current:
        chunks.append(current)
    return chunks
