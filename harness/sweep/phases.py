"""`capsafe sweep`: run a suite many ways, explain every failure, write the report.

Phases, each a method, each a set of pytest subprocesses (harness.sweep.runner):
0. collection: the node ids exactly as `pytest --collect-only -q` prints them, and
   every collection error (class `error`);
1. runs: the whole suite N times under xdist, a different seed each, alternating a
   global shuffle with a bucketed one (module -> class -> test);
2. isolation: every test that ever failed, alone, in R fresh processes; a failure
   alone beside other reruns is confirmed with no other test process alive;
3. searches: for a test that fails in the suite but never alone, replay what ran
   before it to find the polluter; for one that fails alone but passes in the
   suite, the state-setter (harness.sweep.search). A cause counts only once verified
   VERIFY_TIMES times each way; a verified cause is then tried on the victim's
   module siblings and on every failing test. A test that failed only beside other
   workers and passes when its worker's sequence is replayed is `parallel-unsafe`;
4. classification (harness.verdicts.catalogue) and reports (harness.report.render,
   harness.report.history).

Ctrl-C (or SIGTERM, SIGHUP: harness.sweep.termination) and an exhausted --budget both stop new
work and still write the report.
An --out holds one sweep: sweep.json names its options, the runs done, each process's
exit and which alone rerun counts, so --resume can continue it. `Sweep.phases` lists
the phases a sweep drives: a shard (--shard K/N, harness.sweep.shard) does its runs and its
alone reruns and no searches; `capsafe merge` (harness.sweep.merge) loads the shards' records
in place of the first phases and drives the rest.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..plugin import order, phase_times
from ..plugin.collection import Collected
from ..records import Record, Signal, load_records
from ..report import gpu_report, history, placement
from ..report import render as report
from ..report.summary import SearchRecord, Summary, TestVerdict
from ..verdicts import catalogue, fold, stats
from ..verdicts.catalogue import Verdict, why
from ..verdicts.evidence import VERIFY_TIMES, Evidence
from . import capture_sweep, search, termination
from .options import SweepError, SweepOptions
from .runner import (
    PYTEST_NO_RUN,
    Interrupted,
    ProcessResult,
    Runner,
    last_line,
)
from .shard import stable_hash
from .state import STATE_FILE, describe_error, read_state

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_PREFIXES = 2  # failing (or passing) runs whose prefix a search tries before widening
SHUFFLES = ("global", "module")  # run k uses SHUFFLES[(k - 1) % 2]
SHARD_VIEW = "a shard's partial view: its reruns and searches are left to `capsafe merge`"
MAX_BESIDE = 4  # concurrent tests a parallel-unsafe test is run beside, most overlapping first


class _BudgetSpent(Exception):
    """Raised inside a search when --budget runs out between two replays."""


@dataclass
class SweepResult:
    summary: Summary
    exit_code: int
    reason: str


def run_seeds(seed: int, count: int, kind: str = "run") -> list[int]:
    """Seeds derived from the sweep seed, one per run (or per isolation rerun: kind).

    The first run uses the sweep seed itself, so `pytest -p capsafe --capsafe-seed S`
    (with the same workers) reproduces run 1's order without the sweep.
    """
    derived = [
        int.from_bytes(hashlib.sha256(f"capsafe-{kind}:{seed}:{k}".encode()).digest()[:4], "big")
        for k in range(1, count + 1)
    ]
    return [seed, *derived[1:]] if kind == "run" and derived else derived


class Sweep:
    """One sweep: holds the evidence as phases add to it, so an interruption can still report."""

    def __init__(self, options: SweepOptions) -> None:
        self.options = options
        self.started = time.monotonic()
        self.raw = options.out / "raw"
        self.bar = _progress_bar(options.progress)
        self.runner = Runner(options, self.raw, on_tests=self.bar.update)
        self.rows: list[Record] = []  # what the test processes recorded
        self.ends: list[fold.RunOutcome] = []  # how each of them ended
        self.run_ids: list[str] = []
        self.seeds: list[int] = []
        self.shuffles: list[str] = []
        self.run_attempts: dict[tuple[str, str], fold.Attempt] = {}
        self.evidence: dict[str, Evidence] = {}
        self.collected: tuple[str, ...] = ()
        self.searches: list[SearchRecord] = []
        self.notes: list[str] = []
        self.causes: list[tuple[str, tuple[str, ...]]] = []  # (kind, verified culprits)
        self._busy: set[str] = set()  # tests a search or trial is explaining right now
        self._tried: set[tuple[str, ...]] = set()  # (culprits..., test) trials already run
        self._sibling_trials: set[tuple[str, ...]] = set()  # (module, cause...) screened
        self._screen_prefixes: dict[str, tuple[int | None, list[str]]] = {}  # what a screen ran
        self._screen_searched: set[str] = set()  # tests searched from their screen's prefix
        self.capture = capture_sweep.CapturePhases(options.neighbors, store=self.evidence)
        self.clock = phase_times.SweepClock()
        self.neighbors_problem = ""  # why neighbour threads could not start (exit 2)
        self.suite_errors: list[dict[str, Any]] = []  # runs pytest failed with no test failing
        self._labels = 0
        self._lock = threading.RLock()
        self.runs_done: set[int] = set()
        self.processes: dict[str, dict[str, Any]] = {}  # label -> exit code, stalled
        self.alone_done: dict[tuple[str, int], str] = {}  # (test, rerun) -> label that counts
        self.no_searches = SHARD_VIEW if options.shard else ""  # why searches are not run

    # -- driver ---------------------------------------------------------------
    def execute(self) -> SweepResult:
        interrupted = False
        try:
            for name, phase in self.phases():
                if name != "collection" and not self.collected:
                    break
                with self.clock.phase(name):
                    phase()
        except capture_sweep.NeighborsDidNotStart as exc:
            self.neighbors_problem = str(exc)
            self.notes.append(self.neighbors_problem)
        except KeyboardInterrupt:
            interrupted = True
            self.runner.kill_all()
            stopped_by = termination.how()
            self.notes.append(f"interrupted ({stopped_by}): the report covers what ran before it")
        finally:
            self.bar.close()
        return self._finish(interrupted)

    def phases(self) -> list[tuple[str, Callable[[], None]]]:
        """The phases in order, each timed in phase_times (isolation holds the capture reruns
        and attribution). A shard leaves the searches to the merge."""
        steps = [("collection", self._collect), ("runs", self._runs),
                 ("isolation", self._isolation)]  # fmt: skip
        return steps if self.no_searches else [*steps, ("searches", self._searches)]

    def _run_numbers(self) -> list[int]:
        """The suite runs (1-based) this sweep does: all of them, or a shard's share."""
        o = self.options
        return o.shard.runs(o.runs) if o.shard else list(range(1, o.runs + 1))

    def _budget_left(self) -> bool:
        budget = self.options.budget
        return budget is None or time.monotonic() - self.started < budget

    def _skip_for_budget(self, what: str, count: int) -> None:
        if count:
            self.notes.append(f"budget of {self.options.budget:g}s spent: skipped {count} {what}")

    def _label(self, kind: str) -> str:
        with self._lock:
            self._labels += 1
            shard = self.options.shard  # shards' labels never collide in a merge
            return f"{kind}-s{shard.index}-{self._labels}" if shard else f"{kind}-{self._labels}"

    def _ev(self, nodeid: str) -> Evidence:
        with self._lock:
            return self.evidence.setdefault(nodeid, Evidence(nodeid))

    # -- phase 0: collection --------------------------------------------------
    def _collect(self) -> None:
        self.take_collection(self.runner.collect())

    def take_collection(self, found: Collected) -> None:
        """The suite's node ids and collection errors (pytest's, or a shard's, loaded)."""
        self.collected = found.nodeids
        for nodeid, message in found.errors.items():
            ev = self._ev(nodeid)
            ev.collect_error = ev.message = message
        if not found.nodeids and not found.errors:
            raise SweepError("pytest could not run the suite (exit 5): no tests were collected")
        self.bar.total = len(self._run_numbers()) * len(found.nodeids)

    # -- phase 1: runs --------------------------------------------------------
    def _runs(self) -> None:
        o = self.options
        if o.resume:
            self._resume()
        self._write_state()
        seeds = run_seeds(o.seed, o.runs)
        todo = [k for k in self._run_numbers() if k not in self.runs_done]
        for i, k in enumerate(todo):
            run_id, seed, shuffle = f"run-{k}", seeds[k - 1], shuffle_of(k)
            if self.run_ids and not self._budget_left():
                self._skip_for_budget("suite runs", len(todo) - i)
                break
            cmd = self.runner.pytest_command(
                self.runner.targets(), self.raw / run_id, run_id, seed=seed,
                workers=o.workers, shuffle=shuffle,
            )  # fmt: skip
            try:
                result = self.runner.run(run_id, cmd)
            except Interrupted as stop:
                self._add_run(run_id, seed, shuffle, stop.result, finished=False)
                raise
            self._check_ran(result)
            capture_sweep.check_started(self.raw / run_id)
            self._add_run(run_id, seed, shuffle, result)
            self.runs_done.add(k)
            self._write_state()

    def _resume(self) -> None:
        """The runs the sweep in --out finished: their records become evidence again."""
        state = read_state(self.options.out)
        done = sorted(int(k) for k in state["runs_done"])
        for k in done:
            self.load_run(k, state.get("processes", {}))
        kept = {f"run-{k}" for k in done} | {f"run-{k}.log" for k in done} | {"shared"}
        for entry in self.raw.iterdir():  # replays of the interrupted sweep: redone
            if entry.name not in kept and entry.name != "collected.json":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        self.notes.append(f"resumed: {len(done)} of {self.options.runs} runs from the sweep before")

    def load_run(self, k: int, facts: Mapping[str, Any]) -> None:
        """Suite run k from its records in raw/ (a resumed sweep's, or a shard's copied in)."""
        run_id = f"run-{k}"
        seed = run_seeds(self.options.seed, k)[k - 1]
        self._add_run(run_id, seed, shuffle_of(k), self.reload(run_id, facts))
        self.runs_done.add(k)
        self.bar.update(len(self.collected))

    def reload(self, label: str, facts: Mapping[str, Any]) -> ProcessResult:
        """A finished process's result from its records, with sweep.json's facts about it
        (exit code, killed stalled, lost): what harness.sweep.runner made of it when it ran."""
        fact = facts.get(label, {})
        stalled = bool(fact.get("stalled", False))
        rows, malformed = load_records(self.raw / label)
        end = fold.RunOutcome(
            label, int(fact.get("returncode", 0)),
            stalled_after=self.options.stall_limit if stalled else None,
            lost=str(fact.get("lost", "")), killed=fold.killed(rows),
        )  # fmt: skip
        return ProcessResult(label, rows, end, self.raw / f"{label}.log", malformed)

    def _write_state(self) -> None:
        """sweep.json: the options and runs done, and what --resume and `capsafe merge` need
        besides the records: where pytest ran, each process's exit, which alone rerun counts."""
        with self._lock:
            state = {
                "options": self.options.identity(),
                "runs_done": sorted(self.runs_done),
                "invoked_from": str(self.options.invoked_from or Path.cwd()),
                "processes": dict(self.processes),
                "alone": [
                    [n, rerun, label] for (n, rerun), label in sorted(self.alone_done.items())
                ],
            }
        (self.options.out / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")

    def _add_run(
        self, run_id: str, seed: int, shuffle: str, result: ProcessResult, *, finished: bool = True
    ) -> None:
        self.run_ids.append(run_id)
        self.seeds.append(seed)
        self.shuffles.append(shuffle)
        self._take(result)
        found = result.attempts()
        if finished:
            self._check_suite_exit(result, found.values())
        self.run_attempts.update(found)
        for attempt in found.values():
            self.capture.saw(attempt, neighbors=bool(self.options.neighbors))
            ev = self._ev(attempt.nodeid)
            ev.runs += 1
            ev.failures += attempt.failed
            ev.signals |= attempt.signals
            if attempt.failed and not ev.message:
                ev.message = attempt.message

    def _check_suite_exit(self, result: ProcessResult, found: Iterable[fold.Attempt]) -> None:
        """A suite run pytest calls failed while every test in it passed (a raising session
        hook, a hang after the last test, `--cov-fail-under`): no test's verdict says so,
        so the sweep's does (pytest's exit code is never greener than the sweep's)."""
        if result.returncode == 0 or any(a.failed for a in found):
            return
        if any(ev.collect_error for ev in self.evidence.values()):
            return  # pytest's exit 1 is the collection errors', already each an `error`
        message = (self._stall_text(result) if result.stalled
                   else last_line(result.log, past_counts=True) or f"see {result.log}")  # fmt: skip
        self.suite_errors.append({"run_id": result.label, "returncode": result.returncode,
                                  "message": message, "log": str(result.log)})  # fmt: skip
        self.notes.append(f"{result.label}: pytest exited {result.returncode} with no test "
                          f"failing: {message} (see {result.log})")  # fmt: skip

    def _check_ran(self, result: ProcessResult) -> None:
        if result.rows or result.stalled:
            return
        detail = last_line(result.log) or f"see {result.log}"
        if result.returncode == 0:  # pytest ran tests, and capsafe's plugin saw none of them
            raise SweepError(f"pytest ran the suite (exit 0: {detail}) but capsafe's plugin "
                             "recorded no test: is it disabled (-p no:capsafe in the arguments "
                             "or in addopts)?")  # fmt: skip
        if result.returncode not in PYTEST_NO_RUN:
            return
        raise SweepError(f"pytest could not run the suite (exit {result.returncode}): {detail}")

    def _take(self, result: ProcessResult) -> None:
        with self._lock:
            self.rows += result.rows
            self.ends.append(result.end)
            fact: dict[str, Any] = {"returncode": result.returncode, "stalled": result.stalled}
            if result.end.lost:
                fact["lost"] = result.end.lost
            self.processes[result.label] = fact
            if result.malformed:
                self.notes.append(
                    f"{result.label}: skipped {result.malformed} malformed record line(s) "
                    f"in {self.raw / result.label}"
                )
            if result.stalled:
                self.notes.append(f"{result.label}: {self._stall_text(result)}")

    def _stall_text(self, result: ProcessResult) -> str:
        limit = self.options.stall_limit
        inside = result.killed_in
        where = (f"in {', '.join(inside)}, recorded as timed out" if inside else
                 "outside any test (in start-up, collection, between tests or after the "
                 "last one)")  # fmt: skip
        return f"no progress for {limit:g}s; the process was killed {where}"

    # -- phase 2: isolation ---------------------------------------------------
    def _isolation(self) -> None:
        """Rerun every failing test alone, `isolation_runs` times; rerun i adds
        `extra_args[i % len(extra_args)]` to its pytest command (with --neighbors: without
        and with them in turn). Capture-error failures are rerun batched first
        (harness.sweep.capture_sweep), with their attribution on the same pool. A shard reruns
        only the tests of its bucket and leaves the capture reruns, which need every run's
        evidence, to the merge; reruns already done (loaded from shards) are not redone."""
        o = self.options
        failing = sorted(n for n, ev in self.evidence.items() if ev.failures)
        runs = o.isolation_runs
        batch_seeds = run_seeds(o.seed, runs, "batch")
        host = capture_sweep.SweepHost(self)
        if o.shard is None:
            failing = self.capture.isolate(host, failing, runs, batch_seeds, o.seed)
        else:
            suspects = {n for n, ev in list(self.evidence.items()) if ev.capture.suspect}
            failing = [n for n in failing if o.shard.owns(n, o.seed) and n not in suspects]
        extra_args = self.capture.alone_args()
        jobs = [(n, i) for n in failing for i in range(runs) if (n, i) not in self.alone_done]

        def alone(job: tuple[str, int], _: int) -> list[Any]:
            nodeid, rerun = job
            extra = tuple(extra_args[rerun % len(extra_args)])
            seed = stable_hash(o.seed, "alone", nodeid, rerun)  # whichever shard reruns it
            failed, signals, _, label = self._alone(nodeid, seed, extra)
            self.count_alone(nodeid, rerun, failed, signals, label)
            return []

        self._pool("isolation reruns", jobs, alone, target=lambda job: job[0])
        if o.shard is None:
            self.capture.attribute_late(host, failing, o.seed)
            self.capture.protect(host, o.protect, runs, batch_seeds)
        self._write_state()

    def count_alone(
        self, nodeid: str, rerun: int, failed: bool | None, signals: frozenset[str], label: str
    ) -> None:
        """Count alone rerun `rerun` of `nodeid` (run as `label`) as evidence."""
        with self._lock:
            ev = self._ev(nodeid)
            if failed is None:
                self.notes.append(f"{nodeid}: did not run alone (see the alone-*.log files)")
                return
            ev.isolation_runs += 1
            ev.isolation_failures += failed
            ev.signals |= signals
            self.alone_done[(nodeid, rerun)] = label
        self.capture.saw_alone(nodeid, failed, signals, rerun)

    def _alone(
        self, nodeid: str, seed: int | None, extra: Sequence[str] = ()
    ) -> tuple[bool | None, frozenset[str], int, str]:
        """One rerun alone: (failed?, signals, replays, the label of the one that counts).
        A failure beside other test processes (they share the working directory) is
        confirmed with none alive, and only that result counts. A test expected to fail (it
        failed every suite run, or alone before) runs with none alive at once: its failure
        needs that anyway."""
        label = self._label("alone")
        if self._width() > 1 and self._expected_to_fail_alone(nodeid):
            failed, signals = self._replay([], nodeid, seed, "alone", extra=extra, exclusive=True,
                                           label=label)  # fmt: skip
            return failed, signals, 1, label
        failed, signals = self._replay([], nodeid, seed, "alone", extra=extra, label=label)
        if not failed or self._width() == 1:
            return failed, signals, 1, label
        label = self._label("alone")
        failed, signals = self._replay([], nodeid, seed, "alone", extra=extra, exclusive=True,
                                       label=label)  # fmt: skip
        return failed, signals, 2, label

    def _expected_to_fail_alone(self, nodeid: str) -> bool:
        with self._lock:
            ev = self._ev(nodeid)
            return ev.isolation_failures > 0 or 0 < ev.runs == ev.failures

    # -- phase 3: searches ----------------------------------------------------
    def _search_jobs(self) -> list[tuple[str, ...]]:
        """(kind, test) for every test whose verdict needs a cause search."""
        jobs: list[tuple[str, ...]] = []
        for nodeid, ev in sorted(self.evidence.items()):
            if not ev.failures or not ev.isolation_runs or self.capture.capture_unsafe(nodeid):
                continue
            if not ev.ever_failed_alone:
                jobs.append(("polluter", nodeid))
            elif ev.always_failed_alone:
                jobs.append(("state-setter", nodeid))
        return jobs

    def _searches(self) -> None:
        jobs = self._search_jobs()
        self._pool("cause searches", jobs, self._search_job, target=_explained_test)

    def _search_job(self, job: tuple[str, ...], _: int) -> list[tuple[str, ...]]:
        """A job is (kind, test), ("trial", kind, culprits..., test) or ("screen", kind,
        culprits..., module)."""
        kind, nodeid = job[0], job[-1]
        if kind == "screen":
            return self._screen_module(job[1], tuple(job[2:-1]), nodeid)
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
            ev = self._ev(nodeid)
            if nodeid in self._busy or ev.polluters or ev.state_setters or ev.concurrent:
                return False
            self._busy.add(nodeid)
            return True

    def _oracle(self, nodeid: str, want_failed: bool, seed: int | None) -> search.Oracle:
        def oracle(tests: Sequence[str]) -> bool:
            if not self._budget_left():
                raise _BudgetSpent
            failed, _ = self._replay(list(tests), nodeid, seed, "replay")
            return failed is want_failed

        return oracle

    def _search(self, kind: str, nodeid: str) -> list[tuple[str, ...]]:
        """Try the prefixes most likely to hold the cause, stop at the first that reproduces
        and verifies; then try the cause on other tests (returned as trial jobs)."""
        want_failed = kind == "polluter"
        tried: list[list[str]] = []
        replays, candidates, capped = 0, 0, False
        with self._lock:
            hints = [c for k, c in self.causes if k == kind]
        for seed, prefix in self._prefixes(nodeid, want_failed):
            if prefix in tried or not prefix:
                continue
            tried.append(prefix)
            try:
                result = search.search(
                    nodeid, prefix, self._oracle(nodeid, want_failed, seed), hints=hints
                )
            except _BudgetSpent:
                self.notes.append(f"budget spent during the {kind} search for {nodeid}")
                self._ev(nodeid).budget_cut = True
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
                with self._lock:
                    self._ev(nodeid).unconfirmed = list(result.culprits)
                break
        else:
            self._record(SearchRecord(nodeid, kind, candidates, replays, 0, [], False, capped))
        if capped:
            self.notes.append(
                f"{nodeid}: the {kind} search stopped at its cap of {search.DDMIN_CAP} ddmin "
                "replays"
            )
        if want_failed:
            self._parallel_check(nodeid)
        return []

    def _verify(
        self, kind: str, culprits: Sequence[str], nodeid: str, seed: int | None
    ) -> tuple[bool, int]:
        """(culprits reproduce K times with no other process alive, and the test alone does
        the opposite K times?, replays spent). Alone runs already done count towards K."""
        want_failed = kind == "polluter"
        spent = 0
        ev = self._ev(nodeid)
        for _ in range(VERIFY_TIMES):
            if not self._budget_left():
                ev.budget_cut = True
                return False, spent
            spent += 1
            failed, _ = self._replay(list(culprits), nodeid, seed, "verify", exclusive=True)
            if failed is not want_failed:
                return False, spent

        def alone_agrees() -> bool:  # a polluter's victim never fails alone, a brittle test always
            return not ev.ever_failed_alone if want_failed else ev.always_failed_alone

        while ev.isolation_runs < VERIFY_TIMES and alone_agrees():
            if not self._budget_left():
                ev.budget_cut = True
                return False, spent
            failed, signals, replays, _ = self._alone(nodeid, seed)
            spent += replays
            if failed is None:
                return False, spent
            with self._lock:
                ev.isolation_runs += 1
                ev.isolation_failures += failed
                ev.signals |= signals
        if not alone_agrees():
            return False, spent
        with self._lock:
            if want_failed:
                ev.polluters = list(culprits)
            else:
                ev.state_setters = list(culprits)
            self.causes.append((kind, tuple(culprits)))
        return True, spent

    def _trials(self, kind: str, culprits: Sequence[str], victim: str) -> list[tuple[str, ...]]:
        """Jobs that try a verified cause on other tests. A polluter is screened against every
        module once (the victim's first, then those holding failing tests): cleaners hide
        victims from shuffled runs, and a test that never failed may be one. A state-setter is
        tried on the tests that always failed alone."""
        if kind == "polluter":
            failing = {order.module_of(n) for n in self._failing(kind)}
            modules = list(dict.fromkeys(order.module_of(n) for n in self.collected))
            modules.sort(key=lambda m: (m != order.module_of(victim), m not in failing))
            with self._lock:
                fresh = [m for m in modules if (m, *culprits) not in self._sibling_trials]
                self._sibling_trials.update((m, *culprits) for m in fresh)
            return [("screen", kind, *culprits, m) for m in fresh]
        return self._screened(
            kind, culprits, [n for n in self._failing(kind) if n != victim and n not in culprits]
        )

    def _failing(self, kind: str) -> list[str]:
        """Tests that failed in the suite and alone as a `kind` would explain: a polluter's
        victims never fail alone, a state-setter's always do."""
        with self._lock:
            return [
                n for n, ev in self.evidence.items()
                if ev.failures and ev.isolation_runs and ev.collect_error is None
                and (ev.always_failed_alone if kind == "state-setter" else not ev.ever_failed_alone)
            ]  # fmt: skip

    def _screen_module(
        self, kind: str, culprits: tuple[str, ...], module: str
    ) -> list[tuple[str, ...]]:
        tests = [n for n in self.collected if order.module_of(n) == module and n not in culprits]
        return self._screened(kind, culprits, tests)

    def _screened(
        self, kind: str, culprits: Sequence[str], tests: list[str]
    ) -> list[tuple[str, ...]]:
        """Trial jobs for the unexplained tests that, in one replay of the cause then all of
        `tests`, did what the cause explains: one replay screens a module, each trial
        verifies. Explained tests stay in the replay (one may be a victim's second
        polluter), and what ran before a target is kept: when the cause alone does not
        reproduce, the target's search starts from it."""
        targets = [n for n in tests if not self._explained(n)]
        if not targets or len(tests) < 2 or not self._budget_left():  # the trial is the screen
            return [("trial", kind, *culprits, n) for n in targets]
        seed = self.seeds[0] if self.seeds else None
        sequence = [*culprits, *tests]
        found, _ = self._replay_sequence(sequence, seed, "screen")
        want_failed = kind == "polluter"
        hit = [n for n in targets if n not in found or found[n].failed is want_failed]
        with self._lock:
            for n in hit:
                self._screen_prefixes.setdefault(n, (seed, sequence[: sequence.index(n)]))
        return [("trial", kind, *culprits, n) for n in hit]

    def _explained(self, nodeid: str) -> bool:
        with self._lock:
            ev = self.evidence.get(nodeid)
            return ev is not None and bool(ev.polluters or ev.state_setters or ev.concurrent)

    def _trial(self, kind: str, culprits: tuple[str, ...], nodeid: str) -> list[tuple[str, ...]]:
        """One replay of a known cause before another test; verified like any search."""
        ev = self._ev(nodeid)
        with self._lock:
            if (*culprits, nodeid) in self._tried:
                return []
            self._tried.add((*culprits, nodeid))
        if kind == "polluter" and ev.ever_failed_alone:
            return []
        seed = self.seeds[0] if self.seeds else None
        oracle = self._oracle(nodeid, kind == "polluter", seed)
        try:
            if len(culprits) == 1:
                reproduced, replays = oracle(culprits), 1
            else:  # another test's cause may hold more than this one needs: minimise it
                found = search.search(nodeid, culprits, oracle)
                reproduced, replays = found.reproduced, found.replays
                culprits = found.culprits if found.reproduced else culprits
        except _BudgetSpent:
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
        return [] if reproduced or searched else [(kind, nodeid)]

    def _parallel_check(self, nodeid: str) -> None:
        """parallel-unsafe: it failed only beside other workers, and its worker's sequence
        replayed in one process with no other process alive passes K times."""
        fails = [a for a in self.run_attempts.values() if a.nodeid == nodeid and a.failed]
        beside = [(a, fold.concurrent_with(self.run_attempts, a)) for a in fails]
        if self.options.workers < 2 or not fails or not all(others for _, others in beside):
            return
        ev = self._ev(nodeid)
        if ev.ever_failed_alone:
            return
        first = fails[0]
        sequence = fold.process_sequence(self.run_attempts, first)
        for _ in range(VERIFY_TIMES):
            if not self._budget_left():
                return
            failed, _ = self._replay(sequence, nodeid, first.seed, "sequence", exclusive=True)
            if failed is not False:
                return
        common = set.intersection(*(set(others) for _, others in beside))
        with self._lock:
            ev.concurrent = sorted(common) or sorted({n for _, o in beside for n in o})
        overlaps = Counter(n for _, others in beside for n in others)
        candidates = sorted(ev.concurrent, key=lambda n: -overlaps[n])[:MAX_BESIDE]
        partner = self._collision(nodeid, first.seed, candidates)
        if partner is not None:
            with self._lock:
                ev.collides_with = [partner]

    def _collision(self, nodeid: str, seed: int | None, candidates: list[str]) -> str | None:
        """The candidate that, started in its own process together with `nodeid` alone,
        makes it fail K times of K (one pair run screens a candidate); None if none does."""
        for partner in candidates:
            failed = 0
            while failed < VERIFY_TIMES and self._budget_left():
                if self._beside(nodeid, partner, seed) is not True:
                    break
                failed += 1
            if failed == VERIFY_TIMES:
                return partner
        return None

    def _beside(self, nodeid: str, partner: str, seed: int | None) -> bool | None:
        """Did `nodeid` fail, run alone in one process while `partner` ran in another, and
        no other process of the sweep ran?"""
        with self.runner.only() as group, concurrent.futures.ThreadPoolExecutor(1) as pair:
            other = pair.submit(self._replay, [], partner, seed, "beside", group=group)
            failed, _ = self._replay([], nodeid, seed, "beside", group=group)
            other.result()
        return failed

    def _record(self, record: SearchRecord) -> None:
        with self._lock:
            self.searches.append(record)

    def _prefixes(self, nodeid: str, want_failed: bool) -> Iterable[tuple[int | None, list[str]]]:
        """(seed, candidates) to search, best first: the test's own process in runs where it
        did what we explain, then everything that ran before it in that run, then what
        precedes it in the project's own order, then every other test with modules (and
        classes) kept together and the test's module last, so module- and class-scoped
        fixtures live as in the project's own order."""
        mine = [
            a for a in self.run_attempts.values() if a.nodeid == nodeid and a.failed is want_failed
        ]
        mine.sort(key=lambda a: self.run_ids.index(a.run_id))
        with self._lock:
            screened = self._screen_prefixes.get(nodeid) if want_failed else None
        if screened is not None:
            yield screened
        for attempt in mine[:MAX_PREFIXES]:
            yield attempt.seed, fold.process_sequence(self.run_attempts, attempt)
        for attempt in mine[:1]:
            yield attempt.seed, fold.run_sequence(self.run_attempts, attempt)
        if nodeid in self.collected:  # the project's own order
            yield None, list(self.collected[: self.collected.index(nodeid)])
        others = [n for n in self.collected if n != nodeid]
        yield (
            (self.seeds[0] if self.seeds else None),
            search.grouped(others, order.module_of(nodeid)),
        )

    # -- replays --------------------------------------------------------------
    def _replay(
        self,
        before: list[str],
        target: str,
        seed: int | None,
        kind: str,
        *,
        extra: Sequence[str] = (),
        exclusive: bool = False,
        label: str = "",
        group: object = None,
    ) -> tuple[bool | None, frozenset[str]]:
        """Run `before` then `target` in one fresh process (as `label`: default, the next of
        `kind`; `group`: a `Runner.only()` token). (target failed?, its signals); failed is
        None when the target did not run at all (not collected, usage error)."""
        found, returncode = self._replay_sequence(
            [*before, target], seed, kind, extra=extra, exclusive=exclusive, label=label,
            group=group,
        )  # fmt: skip
        return target_outcome(found.get(target), returncode)

    def _replay_sequence(
        self,
        sequence: list[str],
        seed: int | None,
        kind: str,
        *,
        extra: Sequence[str] = (),
        exclusive: bool = False,
        label: str = "",
        group: object = None,
    ) -> tuple[dict[str, fold.Attempt], int]:
        """Run `sequence` in one fresh process: (each test's attempt by id, exit code)."""
        if self.runner.stopping.is_set():
            raise KeyboardInterrupt
        label = label or self._label(kind)
        replay_file = self.raw / "replays" / f"{label}.txt"
        order.write_replay(replay_file, sequence)
        cmd = self.runner.pytest_command(
            self.runner.replay_targets(sequence), self.raw / label, label, seed=seed,
            workers=0, replay_file=replay_file, extra=extra,
        )  # fmt: skip
        if self.bar.total is not None:
            self.bar.total += len(sequence)
        result = self.runner.run(label, cmd, exclusive=exclusive, group=group, sequence=sequence)
        self._take(result)
        found = {a.nodeid: a for (run, _), a in result.attempts().items() if run == label}
        return found, result.returncode

    def _width(self) -> int:
        # Reruns are single-process: without xdist still use a few cores for them.
        return self.options.workers or min(4, os.cpu_count() or 1)

    def _pool(
        self,
        desc: str,
        jobs: Sequence[Any],
        work: Callable[[Any, int], list[Any]],
        target: Callable[[Any], str | None] | None = None,
    ) -> None:
        """Run jobs on up to `workers` threads (each drives one subprocess); a job returns
        more jobs to queue. Stops starting jobs when the budget is spent; the tests of the
        jobs left undone (`target` of a job) are marked budget-cut."""
        width = self._width()
        queue = list(jobs)
        started, skipped = 0, 0
        with concurrent.futures.ThreadPoolExecutor(width) as pool:
            pending: set[concurrent.futures.Future[list[Any]]] = set()
            try:
                while queue or pending:
                    while queue and len(pending) < width:
                        if not self._budget_left():
                            for job in queue:
                                test = None if target is None else target(job)
                                if test is not None:
                                    self._ev(test).budget_cut = True
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
                        queue += future.result()
            except BaseException:
                self.runner.kill_all()
                for future in pending:
                    future.cancel()
                raise
        self._skip_for_budget(desc, skipped)

    # -- phase 4: verdicts and reports ----------------------------------------
    def verdicts(self, *, stopped: bool = False) -> list[TestVerdict]:
        """One verdict per test. A collected test no process reached gets one too ("never
        ran"), unless the sweep was `stopped` short: then a note counts them instead."""
        replays_dir = self.options.out / "replays"
        tests = []
        runs = len(self.run_ids)
        if self.no_searches:  # a shard, or `merge --no-run`: what needs a search is unverified
            for job in self._search_jobs():
                self._ev(job[-1]).budget_cut = True
        ran = {nodeid for nodeid, ev in self.evidence.items() if ev.ran}
        unreached = [n for n in self.collected if n not in ran]
        if stopped and unreached:
            self.notes.append(f"{len(unreached)} of {len(self.collected)} collected tests had "
                              "not run when the sweep stopped")  # fmt: skip
        elif unreached:
            for nodeid in unreached:
                self._ev(nodeid)
            self._note_unmatched_ids(unreached, ran - set(self.collected))
        for nodeid in sorted(self.evidence):
            ev = self.evidence[nodeid]
            verdict = catalogue.classify(ev)
            replay = ""
            if verdict not in (Verdict.PASS, Verdict.ERROR):
                sequence = (
                    [*ev.polluters, nodeid] if verdict == Verdict.ORDER_DEPENDENT else [nodeid]
                )
                replay_file = replays_dir / f"{_slug(nodeid)}.txt"
                order.write_replay(replay_file, sequence)
                replay = self.runner.replay_command(replay_file.resolve(), sequence)
            low, high = stats.wilson_interval(ev.failures, ev.runs)
            rate = stats.flake_rate(ev.failures, ev.runs)
            seen = verdict != Verdict.PASS and ev.ran
            chance = round(1 - (1 - rate) ** runs, 6) if seen else None
            unsafe = verdict == Verdict.CAPTURE_UNSAFE
            tests.append(TestVerdict(
                nodeid=nodeid, classification=verdict,
                why=self.capture.why(nodeid) if unsafe else why(verdict, ev, self.no_searches),
                runs=ev.runs, failures=ev.failures, flake_rate=round(rate, 6),
                flake_rate_ci=(round(low, 6), round(high, 6)), detection_chance=chance,
                isolation_runs=ev.isolation_runs, isolation_failures=ev.isolation_failures,
                polluters=ev.polluters, state_setters=ev.state_setters,
                unconfirmed=ev.unconfirmed, concurrent=ev.concurrent,
                collides_with=ev.collides_with,
                signals=sorted(ev.signals), message=ev.message if verdict != Verdict.PASS else "",
                replay=replay, capture=self.capture.test_fields(nodeid, replay) if unsafe else None,
            ))  # fmt: skip
        return tests

    def _note_unmatched_ids(self, never: Sequence[str], strangers: set[str]) -> None:
        """Say so when collected tests never ran while uncollected ones did: the suite's
        node ids differ from process to process, and "never ran" may be only that."""
        if not strangers:
            return
        note = (f"{len(never)} collected test(s) never ran while {len(strangers)} test(s) "
                f"ran that collection did not list (e.g. {min(strangers)}): the suite's node "
                "ids differ between processes (parametrize ids made from random or "
                "time-dependent values?)")  # fmt: skip
        if note not in self.notes:
            self.notes.append(note)

    def _finish(self, interrupted: bool) -> SweepResult:
        o = self.options
        out = o.out
        tests = self.verdicts(stopped=interrupted or bool(self.neighbors_problem))
        summary = Summary(
            runs=len(self.run_ids), workers=o.workers, seeds=self.seeds,
            shuffles=self.shuffles, backend=requested_backend(),
            duration_s=round(time.monotonic() - self.started, 3), tests=tests,
            counts={c: sum(t.classification == c for t in tests) for c in catalogue.CLASSES},
            searches=self.searches, notes=self.notes, ddmin_cap=search.DDMIN_CAP,
            verify_times=VERIFY_TIMES,
            phase_times=phase_times.summary_times(self.clock, self.raw, self.rows),
            shard="" if o.shard is None else str(o.shard), suite_errors=self.suite_errors,
        )  # fmt: skip
        every = fold.attempts(self.rows, self.ends)
        summary.placement = placement.placement_section(every.values())
        summary.gpu = gpu_report.gpu_section(
            [t.__dict__ for t in tests], self.rows, capture_sweep.neighbor_summary(self.raw)
        )
        past = self._history(tests) if o.shard is None else []  # the merge writes the history
        self._write_state()
        report.write_reports(
            out, summary, self.rows, self._grid(), self.run_ids, past, ends=self.ends
        )
        if self.neighbors_problem:
            return SweepResult(summary, EXIT_USAGE, f"{self.neighbors_problem}; report: {out}")
        if o.shard is not None and self.collected and not interrupted:
            mine = len(self._run_numbers())
            done = (f"done ({mine} runs, {len(self.alone_done)} alone reruns); verdicts come "
                    "from `capsafe merge OUT` over every shard's --out"
                    if len(self.runs_done) == mine else f"stopped after {len(self.runs_done)} "
                    f"of its {mine} runs: `--resume` it before `capsafe merge`")  # fmt: skip
            where = f"partial report: {out / 'report.html'}"
            return SweepResult(summary, EXIT_OK, f"shard {o.shard} {done}; {where}")
        return _outcome(summary, o.baseline, interrupted, out, bool(self.collected))

    def _history(self, tests: Sequence[TestVerdict]) -> list[dict[str, str]]:
        """One history.csv row per test beside --out, and `latest`; this suite's history."""
        out = self.options.out
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        verdicts = [
            history.Verdict(t.nodeid, t.classification, t.runs, t.failures, t.flake_rate)
            for t in tests
        ]
        past = self._append_history(out.parent / history.HISTORY_FILE, out.name, stamp, verdicts)
        try:
            history.point_latest(out)
        except OSError as exc:
            self.notes.append(f"{out.parent / history.LATEST} not updated: {describe_error(exc)}")
        return past

    def _append_history(
        self, path: Path, sweep_id: str, stamp: str, verdicts: list[history.Verdict]
    ) -> list[dict[str, str]]:
        """Append to history.csv; one that is not a history file is set aside, never lost,
        and a history that cannot be written is a note, not a lost report."""
        suite = history.suite_key(self.options.paths)
        try:
            try:
                return history.append_history(path, sweep_id, stamp, verdicts, suite=suite)
            except history.HistoryError as exc:
                aside = history.set_aside(path)
                self.notes.append(f"{exc}; moved to {aside.name}, history starts afresh")
                return history.append_history(path, sweep_id, stamp, verdicts, suite=suite)
        except (OSError, history.HistoryError) as exc:
            self.notes.append(f"{path} not updated: {describe_error(exc)}")
            return []

    def _grid(self) -> dict[str, list[str]]:
        grid: dict[str, list[str]] = {}
        for nodeid in self.evidence:
            states = []
            for run_id in self.run_ids:
                a = self.run_attempts.get((run_id, nodeid))
                states.append(report.Cell.NOT_RUN if a is None else _cell(a))
            grid[nodeid] = states
        return grid


def _explained_test(job: tuple[str, ...]) -> str | None:
    """The test a search job would explain (None for a module's screen)."""
    return None if job[0] == "screen" else job[-1]


def shuffle_of(k: int) -> str:
    """The shuffle of suite run k (1-based): global and bucketed in turn."""
    return SHUFFLES[(k - 1) % len(SHUFFLES)]


def target_outcome(
    attempt: fold.Attempt | None, returncode: int
) -> tuple[bool | None, frozenset[str]]:
    """A replayed test's (failed?, signals) from its attempt and its process's exit code;
    failed is None when it did not run at all (not collected, usage error)."""
    if attempt is not None:
        return attempt.failed, attempt.signals
    if returncode in PYTEST_NO_RUN:
        return None, frozenset()
    return True, frozenset({Signal.CRASH})  # the process died before the test reported: a crash


def requested_backend() -> str:
    """CAPSAFE_BACKEND as the test processes inherit it (a suite's conftest may still pick
    another, as the planted capture suite does)."""
    return os.environ.get("CAPSAFE_BACKEND", "auto").strip().lower() or "auto"


def _progress_bar(enabled: bool) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=0, desc="capsafe sweep", unit="test", file=sys.stderr,
                disable=not enabled, leave=False, dynamic_ncols=True)  # fmt: skip


def _cell(attempt: fold.Attempt) -> str:
    if not attempt.failed:
        return report.Cell.PASSED
    if Signal.CRASH in attempt.signals:
        return report.Cell.CRASH
    if Signal.TIMEOUT in attempt.signals:
        return report.Cell.TIMEOUT
    return report.Cell.FAILED


def _slug(nodeid: str) -> str:
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:80]
    return f"{readable}-{hashlib.sha1(nodeid.encode()).hexdigest()[:8]}"


def _outcome(
    summary: Summary, baseline: frozenset[str], interrupted: bool, out: Path, collected: bool
) -> SweepResult:
    bad = [t for t in summary.tests if t.classification != Verdict.PASS]
    found = [t for t in bad if t.nodeid not in baseline]
    quarantined = len(bad) - len(found)
    where = f"report: {out / 'report.html'}"
    if interrupted:
        return SweepResult(summary, EXIT_INTERRUPTED, f"interrupted; partial {where}")
    if not collected:
        return SweepResult(summary, EXIT_USAGE,
                           f"no test could be collected ({len(bad)} collection error(s)); "
                           f"{where}")  # fmt: skip
    suite = report.suite_errors_text(summary.suite_errors, summary.runs)
    if found:
        by_class = Counter(t.classification for t in found)
        kinds = ", ".join(f"{by_class[c]} {c}" for c in catalogue.CLASSES if by_class[c])
        also = f"; {suite}" if suite else ""
        return SweepResult(summary, EXIT_FOUND,
                           f"{len(found)} not passing ({kinds}){also}; {where}")  # fmt: skip
    extra = f" ({quarantined} quarantined by the baseline)" if quarantined else ""
    passing = f"all {len(summary.tests)} tests pass{extra}"
    if suite:
        return SweepResult(summary, EXIT_FOUND, f"{passing}, but {suite}; {where}")
    return SweepResult(summary, EXIT_OK, f"{passing}; {where}")
