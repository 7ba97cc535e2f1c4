"""Phase 2, isolation: every test that ever failed, alone, in R fresh processes; every
other test that ran, alone once within the screen's budget (ScreenBudget; a test that
fails only alone is brittle or flaky, and then gets the other R - 1).

Rerun i adds `extra_args[i % len(extra_args)]` to its pytest command (with --neighbors:
without and with them in turn). A failure alone beside other reruns (they share the
working directory) is confirmed with no other test process alive, and only that result
counts. Capture-error failures are rerun batched first (harness.sweep.capture_sweep),
with their attribution on the same pool. A shard reruns only the tests of its bucket
and leaves the capture reruns, which need every run's evidence, to the merge; reruns
already done (loaded from shards) are not redone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import capture_sweep
from .host import Host, pool_width
from .options import SweepOptions
from .runs import run_seeds
from .shard import stable_hash
from .store import EvidenceStore

WATCH_EVERY_VARIABLE = "--capsafe-watch-env=*"  # an alone run of every test: what it leaves set
SCREEN_FLOOR = 32
"""Tests that never failed which run alone whatever the screen's time budget (a planted
suite's, a small project's: every test)."""
SCREEN_SHARE = 0.5
"""Beyond the floor, the alone screen spends at most this share of one suite run's wall
time per pool thread: a process per test is cheap forked on a CPU suite (tens of ms) and
not on a GPU one (each child makes its CUDA context), and a 2,000-test suite's screen
would otherwise cost more than its runs (issue 21's budget)."""


class Isolation:
    """The alone reruns of one sweep, through its host, into its store."""

    def __init__(
        self, options: SweepOptions, host: Host, store: EvidenceStore,
        capture: capture_sweep.CapturePhases, cwd: Path,
    ) -> None:  # fmt: skip
        self.options = options
        self.host = host
        self.store = store
        self.capture = capture
        self.cwd = cwd  # where the suite's interpreter looks for frameworks (--protect auto)

    def run(self, suite_run_s: float | None = None) -> None:
        """`suite_run_s`: what one suite run took here (the screen's time budget; None, a
        resumed sweep's, screens every test)."""
        o = self.options
        failing = sorted(n for n, ev in self.store.evidence.items() if ev.failures)
        runs = o.isolation_runs
        batch_seeds = run_seeds(o.seed, runs, "batch")
        if o.shard is None:
            failing = self.capture.isolate(self.host, failing, runs, batch_seeds, o.seed)
        else:
            suspects = {n for n, ev in list(self.store.evidence.items()) if ev.capture.suspect}
            failing = [n for n in failing if o.shard.owns(n, o.seed) and n not in suspects]
        extra_args = self.capture.alone_args()
        jobs = [(n, i) for n in failing for i in range(runs)
                if (n, i) not in self.store.alone_done]  # fmt: skip
        screened = self.screen_targets() if runs else []  # --isolation-runs 0: none
        jobs += [(n, 0) for n in screened if (n, 0) not in self.store.alone_done]
        jobs += [(n, i) for n in screened for i in range(1, runs)  # a shard's screen failed it
                 if (n, 0) in self.store.alone_done and self.store.ev(n).isolation_failures
                 and (n, i) not in self.store.alone_done]  # fmt: skip
        only_alone = set(screened)
        budget = ScreenBudget(len(screened), suite_run_s, pool_width(o))

        def alone(job: tuple[str, int], _: int) -> list[Any]:
            nodeid, rerun = job
            screen = rerun == 0 and nodeid in only_alone
            if screen and not budget.admit():
                return []
            extra = tuple(extra_args[rerun % len(extra_args)])
            if rerun == 0 and nodeid in only_alone:  # what it leaves set: a candidate polluter
                extra += (WATCH_EVERY_VARIABLE,)
            seed = stable_hash(o.seed, "alone", nodeid, rerun)  # whichever shard reruns it
            started = time.monotonic()
            failed, signals, _, label = self.alone(nodeid, seed, extra)
            if screen:
                budget.spent(time.monotonic() - started)
            self.count_alone(nodeid, rerun, failed, signals, label)
            if screen and failed:  # brittle, or flaky: rerun it
                return [(nodeid, i) for i in range(1, runs) if (nodeid, i) not in
                        self.store.alone_done]  # fmt: skip
            return []

        self.host.pool("isolation reruns", jobs, alone, target=lambda job: job[0])
        if budget.skipped:
            self.host.note(budget.describe())
        if o.shard is None:
            self.capture.attribute_late(self.host, failing, o.seed)
            self.capture.protect(self.host, o.protect, runs, batch_seeds,
                                 frameworks=self._frameworks)  # fmt: skip

    def screen_targets(self) -> list[str]:
        """The tests that ran and never failed in a suite run: each runs alone once (its rerun
        0), and only one that fails there gets the other reruns. A brittle test whose
        state-setters run before it in every suite run shows only alone (issue 24); forked
        from the fork server, a rerun costs little more than the test itself."""
        o = self.options
        with self.store.lock:
            found = [
                n for n, ev in self.store.evidence.items()
                if ev.runs and not ev.failures and ev.collect_error is None
                and (o.shard is None or o.shard.owns(n, o.seed))
            ]  # fmt: skip
        # In a seeded order: where the budget stops the screen, each night's sweep covers
        # other tests.
        return sorted(found, key=lambda n: stable_hash(o.seed, "screen", n))

    def _frameworks(self) -> tuple[str, ...]:
        """What `--protect auto` finds: asked of the suite's interpreter, in its directory."""
        return capture_sweep.find_frameworks(self.cwd, self.host.note)

    def count_alone(
        self, nodeid: str, rerun: int, failed: bool | None, signals: frozenset[str], label: str
    ) -> None:
        """Count alone rerun `rerun` of `nodeid` (run as `label`) as evidence."""
        with self.store.lock:
            ev = self.store.ev(nodeid)
            if failed is None:
                self.store.notes.append(f"{nodeid}: did not run alone (see the alone-*.log files)")
                return
            ev.isolation_runs += 1
            ev.isolation_failures += failed
            ev.signals |= signals
            self.store.alone_done[(nodeid, rerun)] = label
        self.capture.saw_alone(nodeid, failed, signals, rerun)

    def alone(
        self, nodeid: str, seed: int | None, extra: Sequence[str] = ()
    ) -> tuple[bool | None, frozenset[str], int, str]:
        """One rerun alone: (failed?, signals, replays, the label of the one that counts).
        A failure beside other test processes (they share the working directory) is
        confirmed with none alive, and only that result counts. A test expected to fail (it
        failed every suite run, or alone before) runs with none alive at once: its failure
        needs that anyway."""
        parallel = pool_width(self.options) > 1
        if parallel and self._expected_to_fail_alone(nodeid):
            done = self.host.replay([nodeid], seed=seed, kind="alone", extra=extra, exclusive=True)
            return (*done.outcome(nodeid), 1, done.label)
        done = self.host.replay([nodeid], seed=seed, kind="alone", extra=extra)
        failed, signals = done.outcome(nodeid)
        if not failed or not parallel:
            return failed, signals, 1, done.label
        done = self.host.replay([nodeid], seed=seed, kind="alone", extra=extra, exclusive=True)
        return (*done.outcome(nodeid), 2, done.label)

    def _expected_to_fail_alone(self, nodeid: str) -> bool:
        with self.store.lock:
            ev = self.store.ev(nodeid)
            return ev.isolation_failures > 0 or 0 < ev.runs == ev.failures


class ScreenBudget:
    """How many of the alone screen's `total` tests run: the first SCREEN_FLOOR always,
    then while the screen's summed process seconds stay under SCREEN_SHARE of one suite
    run (`suite_run_s`) per pool thread. Thread-safe (the pool's threads ask it)."""

    def __init__(self, total: int, suite_run_s: float | None, width: int) -> None:
        self.total = total
        self.limit_s = None if suite_run_s is None else SCREEN_SHARE * suite_run_s * width
        self.started = self.skipped = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def admit(self) -> bool:
        with self._lock:
            over = self.limit_s is not None and self.seconds >= self.limit_s
            if self.started >= SCREEN_FLOOR and over:
                self.skipped += 1
                return False
            self.started += 1
            return True

    def spent(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def describe(self) -> str:
        return (
            f"alone screen: {self.started} of {self.total} tests that never failed in a suite "
            f"run ran alone ({self.seconds:.1f} s; the budget: {SCREEN_FLOOR} tests, then "
            f"{SCREEN_SHARE:g} of a suite run per pool thread, {self.limit_s or 0:.1f} s); "
            f"the other {self.skipped}, a seeded choice, were not screened this sweep"
        )
