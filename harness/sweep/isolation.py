"""Phase 2, isolation: every test that ever failed, alone, in R fresh processes; every
other test that ran, alone once (a test that fails only alone is brittle or flaky, and then
gets the other R - 1).

Rerun i adds `extra_args[i % len(extra_args)]` to its pytest command (with --neighbors:
without and with them in turn). A failure alone beside other reruns (they share the
working directory) is confirmed with no other test process alive, and only that result
counts. Capture-error failures are rerun batched first (harness.sweep.capture_sweep),
with their attribution on the same pool. A shard reruns only the tests of its bucket
and leaves the capture reruns, which need every run's evidence, to the merge; reruns
already done (loaded from shards) are not redone.
"""

from __future__ import annotations

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

    def run(self) -> None:
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

        def alone(job: tuple[str, int], _: int) -> list[Any]:
            nodeid, rerun = job
            extra = tuple(extra_args[rerun % len(extra_args)])
            if rerun == 0 and nodeid in only_alone:  # what it leaves set: a candidate polluter
                extra += (WATCH_EVERY_VARIABLE,)
            seed = stable_hash(o.seed, "alone", nodeid, rerun)  # whichever shard reruns it
            failed, signals, _, label = self.alone(nodeid, seed, extra)
            self.count_alone(nodeid, rerun, failed, signals, label)
            if rerun == 0 and failed and nodeid in only_alone:  # brittle, or flaky: rerun it
                return [(nodeid, i) for i in range(1, runs) if (nodeid, i) not in
                        self.store.alone_done]  # fmt: skip
            return []

        self.host.pool("isolation reruns", jobs, alone, target=lambda job: job[0])
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
            return sorted(
                n for n, ev in self.store.evidence.items()
                if ev.runs and not ev.failures and ev.collect_error is None
                and (o.shard is None or o.shard.owns(n, o.seed))
            )  # fmt: skip

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
