"""The one door the phases use to run tests: the `Host` protocol, and the sweep's own.

Modelled on pytest-xdist's scheduler protocol (`xdist.scheduler.protocol.Scheduling`, a
`typing.Protocol` its controller drives): the alone reruns (harness.sweep.isolation),
the cause searches (harness.sweep.searches, .parallel) and the capture phases
(harness.sweep.capture_sweep) ask a `Host` to replay a sequence of tests in one fresh
process, to run a pool of jobs on --workers threads, whether budget is left, and to
note something for the report. None of them touches the runner, the progress bar or
the labels of the processes; a test drives them with a fake host.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..plugin import order
from ..records import Signal
from ..verdicts import fold
from ..verdicts.fold import Attempt
from .journal import Journal, question
from .options import SweepOptions
from .runner import PYTEST_NO_RUN, ProcessResult, Runner
from .store import EvidenceStore

FIX_RECORDS = "fixes"  # under raw/: the records of replays in scratch copies of the suite

Work = Callable[[Any, int], list[Any]]
"""A pool job's work: `work(job, i)` (i: how many jobs started before it) returns more jobs."""


class BudgetSpent(Exception):
    """Raised inside a search when --budget runs out between two replays."""


@dataclass(frozen=True)
class Replayed:
    """One replay process: its tests' attempts by node id, and how pytest exited."""

    label: str
    attempts: dict[str, Attempt]
    returncode: int
    ran: bool  # it recorded at least one row
    log: Path
    runs_failed: dict[str, tuple[bool, ...]] = field(default_factory=dict)  # each run of
    # a test it ran more than once: failed?, in order (`attempts` folds them into one)

    def outcome(self, target: str) -> tuple[bool | None, frozenset[str]]:
        """(did `target` fail?, its signals); failed is None when it did not run at all."""
        return target_outcome(self.attempts.get(target), self.returncode)


def target_outcome(attempt: Attempt | None, returncode: int) -> tuple[bool | None, frozenset[str]]:
    """A replayed test's (failed?, signals) from its attempt and its process's exit code;
    failed is None when it did not run at all (not collected, usage error)."""
    if attempt is not None:
        return attempt.failed, attempt.signals
    if returncode in PYTEST_NO_RUN:
        return None, frozenset()
    return True, frozenset({Signal.CRASH})  # the process died before the test reported: a crash


def outcomes(done: Replayed, sequence: Sequence[str]) -> dict[str, bool | None]:
    """Each test of a replayed sequence: failed? None for one that did not run (after the
    first test a dead process left without a row, which is the one it died in)."""
    found: dict[str, bool | None] = {}
    died = False
    for nodeid in sequence:
        attempt = done.attempts.get(nodeid)
        if attempt is None and died:
            found[nodeid] = None
            continue
        found[nodeid] = target_outcome(attempt, done.returncode)[0]
        died = died or (attempt is None and found[nodeid] is not None)
    return found


class Host(Protocol):
    """What a phase needs of the sweep that runs it."""

    def replay(
        self,
        sequence: Sequence[str],
        *,
        seed: int | None,
        kind: str,
        extra: Sequence[str] = (),
        exclusive: bool = False,
        group: object = None,
    ) -> Replayed:
        """Run `sequence`, in this order, in one fresh process (no xdist) labelled after
        `kind`, with `extra` pytest options; `exclusive`: with no other test process alive;
        `group`: a token of `only()`, whose processes run beside each other alone."""
        ...

    def only(self) -> AbstractContextManager[object]:
        """A token for processes that run side by side with no other process alive."""
        ...

    def pool(
        self, desc: str, jobs: Sequence[Any], work: Work,
        target: Callable[[Any], str | None] | None = None,
    ) -> None:  # fmt: skip
        """Run jobs on up to --workers threads; a job returns more jobs to queue. Once the
        budget is spent no job starts, and the test each one left would explain
        (`target` of the job) is marked budget-cut."""
        ...

    def budget_left(self) -> bool: ...

    def note(self, text: str) -> None:
        """A line for the report's notes."""
        ...


def pool_width(options: SweepOptions) -> int:
    """Threads of a pool, so replay processes at once (--jobs): by default the runs' xdist
    workers, or half the machine's CPUs where that is more (at most 8): reruns are
    single-process, and a 16-core host would otherwise wait on two at a time. A sweep with
    neighbour threads (a GPU suite's) keeps to the workers: its processes share the device.
    Without xdist, min(4, CPUs). A failure seen beside other processes is confirmed with
    none alive (Isolation.alone), so the width changes what a phase costs, not its verdicts."""
    if options.jobs:
        return options.jobs
    cpus = os.cpu_count() or 1
    if not options.workers:
        return min(4, cpus)
    if options.neighbors:  # processes sharing one GPU: 8 at once made each alone rerun 4x
        return options.workers  # slower on the H200 and left an attribution undecided
    return max(options.workers, min(8, cpus // 2))


class SweepHost:
    """The `Host` of a sweep: processes through its runner, evidence into its store."""

    def __init__(
        self, options: SweepOptions, runner: Runner, store: EvidenceStore, bar: Any,
        started: float,
    ) -> None:  # fmt: skip
        self.options = options
        self.runner = runner
        self.store = store
        self.bar = bar
        self.started = started
        self.journal = Journal(store.raw, resume=options.resume)  # finished replays, kept
        self._labels = self.journal.highest_label()  # a resumed sweep's labels follow on
        self._lock = threading.Lock()
        self.one_at_a_time = False  # every replay exclusive: the suite's processes collide
        self.phase = ""  # the sweep phase running now, and its own budget (None: none)
        self.phase_budget: float | None = None
        self.phase_started = started
        self.phase_spent = False  # its budget ran out (noted once)

    def begin_phase(self, name: str, budget: float | None) -> None:
        """A sweep phase starts, with `budget` seconds of its own (None: only --budget)."""
        with self._lock:
            self.phase, self.phase_budget = name, budget
            self.phase_started, self.phase_spent = time.monotonic(), False

    def label(self, kind: str) -> str:
        """The next process label of `kind` ("alone-7"; a shard's: "alone-s2-7")."""
        with self._lock:
            self._labels += 1
            shard = self.options.shard  # shards' labels never collide in a merge
            return f"{kind}-s{shard.index}-{self._labels}" if shard else f"{kind}-{self._labels}"

    def replay(
        self,
        sequence: Sequence[str],
        *,
        seed: int | None,
        kind: str,
        extra: Sequence[str] = (),
        exclusive: bool = False,
        group: object = None,
        root: Path | None = None,
    ) -> Replayed:
        """`root`: run in that scratch copy of the rootdir instead (see `replay_in`)."""
        if self.runner.stopping.is_set():
            raise KeyboardInterrupt
        exclusive = exclusive or (self.one_at_a_time and group is None)
        sequence = list(sequence)
        raw = self.store.raw
        if root is not None:
            return self._replay_rooted(root, sequence, seed, kind, extra, exclusive)
        key = question(kind, seed, extra, exclusive, sequence)
        kept = None if group is not None else self.journal.answer(key, raw)
        if kept is not None:  # finished before an interrupt: --resume does not run it again
            self.store.take(kept)
            self.bar.add(len(sequence))
            self.bar.update(len(sequence))
            return self._replayed(kept)
        label = self.label(kind)
        replay_file = raw / "replays" / f"{label}.txt"
        order.write_replay(replay_file, sequence)
        cmd = self.runner.pytest_command(
            self.runner.replay_targets(sequence), raw / label, label, seed=seed,
            workers=0, replay_file=replay_file, extra=extra,
        )  # fmt: skip
        self.bar.add(len(sequence))
        result = self.runner.run(label, cmd, exclusive=exclusive, group=group, sequence=sequence)
        if group is None and not self.runner.stopping.is_set():  # a stop may have killed it
            self.journal.add(key, result)
        self.store.take(result)
        return self._replayed(result)

    def _replay_rooted(
        self, root: Path, sequence: list[str], seed: int | None, kind: str,
        extra: Sequence[str], exclusive: bool,
    ) -> Replayed:  # fmt: skip
        """A replay in a scratch copy of the rootdir (a candidate fix applied there): one fresh
        process, never forked (a fork server imported the suite's own, unpatched modules),
        never journaled (the copy is gone once the fix is decided) and never evidence of the
        sweep (its tests ran changed code): its records go to raw/fixes/, apart."""
        label = self.label(kind)
        under = self.store.raw / FIX_RECORDS
        replay_file = under / "replays" / f"{label}.txt"
        order.write_replay(replay_file, sequence)
        cwd, targets = self.runner.rooted(root, sequence)
        cmd = self.runner.pytest_command(
            targets, under / label, label, seed=seed, workers=0, replay_file=replay_file,
            extra=extra, root=root,
        )  # fmt: skip
        self.bar.add(len(sequence))
        result = self.runner.run(label, cmd, exclusive=exclusive, sequence=sequence, cwd=cwd,
                                 under=under)  # fmt: skip
        return self._replayed(result)

    def replay_in(self, root: Path, sequence: Sequence[str]) -> dict[str, bool | None]:
        """The fix engine's `ReplayIn` (harness.fix.case): `sequence` in one fresh process
        rooted at `root`; node id -> failed? (None: it did not run). The rootdir itself is
        replayed as any search replay is (forked, journaled)."""
        same = root.resolve() == self.runner.rootdir.resolve()
        done = self.replay(sequence, seed=None, kind="fix", root=None if same else root)
        return outcomes(done, sequence)

    @staticmethod
    def _replayed(result: ProcessResult) -> Replayed:
        label = result.label
        found = {a.nodeid: a for (run, _), a in result.attempts().items() if run == label}
        mine = [r for r in result.rows if r["run_id"] == label]
        return Replayed(label, found, result.returncode, bool(result.rows), result.log,
                        fold.failures_by_run(mine))  # fmt: skip

    @contextmanager
    def only(self) -> Iterator[object]:
        with self.runner.only() as group:
            yield group

    def budget_left(self) -> bool:
        """Neither --budget nor this phase's own budget is spent. The phase that runs out
        says so in the notes, once: what it leaves undone is unverified, never pass."""
        now = time.monotonic()
        budget = self.options.budget
        if budget is not None and now - self.started >= budget:
            return False
        if self.phase_budget is None or now - self.phase_started < self.phase_budget:
            return True
        with self._lock:
            first, self.phase_spent = not self.phase_spent, True
        if first:
            self.note(f"the {self.phase} phase's budget of {self.phase_budget:.0f}s ran out "
                      "(--phase-budget): the tests it left undone are unverified")  # fmt: skip
        return False

    def note(self, text: str) -> None:
        self.store.note(text)

    def skip_for_budget(self, what: str, count: int) -> None:
        if not count:
            return
        if self.phase_spent:
            self.note(f"{self.phase} phase budget of {self.phase_budget:.0f}s spent: skipped "
                      f"{count} {what}")  # fmt: skip
        else:
            self.note(f"budget of {self.options.budget:g}s spent: skipped {count} {what}")

    def pool(
        self, desc: str, jobs: Sequence[Any], work: Work,
        target: Callable[[Any], str | None] | None = None,
    ) -> None:  # fmt: skip
        width = pool_width(self.options)
        queue = list(jobs)
        self.bar.expect(len(queue))  # a test at least each, on the bar before they start
        started, skipped = 0, 0
        with concurrent.futures.ThreadPoolExecutor(width) as pool:
            pending: set[concurrent.futures.Future[list[Any]]] = set()
            try:
                while queue or pending:
                    while queue and len(pending) < width:
                        if not self.budget_left():
                            for job in queue:
                                test = None if target is None else target(job)
                                if test is not None:
                                    self.store.ev(test).budget_cut = True
                            skipped, queue = len(queue), []
                            break
                        pending.add(pool.submit(work, queue.pop(0), started))
                        started += 1
                    if not pending:
                        break
                    done, pending = concurrent.futures.wait(
                        pending, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    for future in done:
                        more = future.result()
                        self.bar.expect(len(more))
                        queue += more
            except BaseException:
                self.runner.kill_all()
                for future in pending:
                    future.cancel()
                raise
        self.bar.release()
        self.skip_for_budget(desc, skipped)
