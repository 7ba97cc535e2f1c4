"""`capsafe sweep`: run a suite many ways, explain every failure, write the report.

This is the one module that sees every stage: it drives the phases, each a module of
pytest subprocesses over one evidence store (harness.sweep.store), then turns the
evidence into verdicts (harness.verdicts) and hands the typed `Summary` to the report
(harness.report):
0-1. collection and the suite runs (harness.sweep.runs);
2. isolation: every failing test alone (harness.sweep.isolation), with the capture
   reruns and attribution (harness.sweep.capture_sweep);
3. parallel: failures that happened only beside another worker, and whom each collides
   with (harness.sweep.parallel), before any order search;
4. searches: polluters and state-setters (harness.sweep.searches); every replay through
   the `Host` (harness.sweep.host);
5. with --fix only, fixes: cleaners and a verified patch per order-dependent and brittle
   verdict (harness.sweep.fixes, over the fix engine harness.fix), into --out/fixes;
6. classification (harness.verdicts.catalogue) and reports (harness.report.render,
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

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..plugin import order, phase_times
from ..records import Outcome, Signal
from ..report import github, gpu_report, history, junit, placement
from ..report.render import write_reports
from ..report.shared import Cell, passing_phrase, suite_errors_text, worst_first
from ..report.summary import Summary, TestVerdict
from ..verdicts import catalogue, fold, stats
from ..verdicts.catalogue import Verdict, why
from ..verdicts.evidence import VERIFY_TIMES
from . import backend_probe, capture_sweep, search, termination
from .fix_files import slug
from .fixes import Fixes
from .host import SweepHost
from .isolation import Isolation
from .options import SweepOptions
from .parallel import ParallelCheck
from .progress import Progress
from .runner import Runner
from .runs import SuiteRuns
from .searches import Searches
from .state import describe_error, prepare_out
from .store import EvidenceStore

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
PHASE_BUDGET_RUNS = 10  # a later phase may take 10x what the suite runs took, by default
PHASE_BUDGET_MIN_S = 600.0  # and at least 10 minutes
SHARD_VIEW = "a shard's partial view: its reruns and searches are left to `capsafe merge`"


@dataclass
class SweepResult:
    summary: Summary
    exit_code: int
    reason: str


def run_sweep(options: SweepOptions) -> SweepResult:
    """Run one whole sweep and write its reports into options.out."""
    prepare_out(options.out, resume=options.resume, force=options.force)
    return Sweep(options).execute()


class Sweep:
    """One sweep: its phases over one evidence store, so an interruption can still report."""

    def __init__(self, options: SweepOptions) -> None:
        self.options = options
        self.started = time.monotonic()
        self.raw = options.out / "raw"
        self.bar = Progress(options.progress)
        self.runner = Runner(options, self.raw, on_tests=self.bar.update)
        self.store = EvidenceStore(self.raw, options.stall_limit, options.out / "records.jsonl")
        self.capture = capture_sweep.CapturePhases(options.neighbors, store=self.store.evidence)
        self.clock = phase_times.SweepClock()
        self.host = SweepHost(options, self.runner, self.store, self.bar, self.started)
        self.suite_runs = SuiteRuns(options, self.host, self.store, self.capture, self.bar)
        self.isolation = Isolation(options, self.host, self.store, self.capture, self.runner.cwd)
        self.parallel = ParallelCheck(options, self.host, self.store)
        self.searches = Searches(self.host, self.store, self.capture, self.isolation, self.parallel)
        self.fixes = Fixes(self.host, self.store, self.host.journal, lambda: self.runner.rootdir,
                           options.out, options.invoked_from or Path.cwd())  # fmt: skip
        self.neighbors_problem = ""  # why neighbour threads could not start (exit 2)
        self.no_searches = SHARD_VIEW if options.shard else ""  # why searches are not run
        self.stopped = ""  # an interrupted sweep's headline: by what, and how much ran

    # -- driver ---------------------------------------------------------------
    def execute(self) -> SweepResult:
        interrupted = False
        name = ""
        try:
            for name, phase in self.phases():
                if name != "collection" and not self.store.collected:
                    break
                self.bar.phase(name)
                self.host.begin_phase(name, self.phase_budget(name))
                with self.clock.phase(name):
                    phase()
        except capture_sweep.NeighborsDidNotStart as exc:
            self.neighbors_problem = str(exc)
            self.store.note(self.neighbors_problem)
        except KeyboardInterrupt:
            interrupted = True
            self.runner.kill_all()
            stopped_by = termination.how()
            self.store.note(f"interrupted ({stopped_by}): the report covers what ran before it")
            self.stopped = self._stopped_line(stopped_by, name)
        finally:
            self.bar.close()
            for line in self.runner.close():
                self.store.note(line)
        return self._finish(interrupted)

    def _stopped_line(self, stopped_by: str, phase: str) -> str:
        """ "Interrupted (Ctrl-C) in the runs phase after 1 of 3 suite runs; 12 of 40
        collected tests ran": the headline's start, so a partial report never reads as a
        whole one."""
        store = self.store
        ran = sum(1 for n in store.collected if n in store.evidence and store.evidence[n].ran)
        runs = len(self.suite_runs.numbers())
        return (f"Interrupted ({stopped_by}) in the {phase} phase after "
                f"{len(store.runs_done)} of {runs} suite runs; {ran} of "
                f"{len(store.collected)} collected tests ran")  # fmt: skip

    def phases(self) -> list[tuple[str, Callable[[], None]]]:
        """The phases in order, each timed in phase_times (isolation holds the capture reruns
        and attribution). Collisions are sorted out before any order search (parallel).
        A shard leaves both to the merge."""
        steps = [("collection", self.suite_runs.collect), ("runs", self.suite_runs.run),
                 ("isolation", self._isolation)]  # fmt: skip
        if self.no_searches:
            return steps
        steps += [("parallel", self._parallel), ("searches", self.searches.run)]
        return [*steps, ("fixes", self.fixes.run)] if self.options.fix else steps

    def phase_budget(self, name: str) -> float | None:
        """Seconds phase `name` may take (--phase-budget): none for collection and the suite
        runs (they are the sweep's floor); for the rest the option's, or by default
        PHASE_BUDGET_RUNS times what the suite runs took, at least PHASE_BUDGET_MIN_S.
        A suite whose runs take seconds once spent 27 minutes in its searches."""
        if name in ("collection", "runs"):
            return None
        chosen = self.options.phase_budget
        if chosen is None:
            return max(PHASE_BUDGET_MIN_S, PHASE_BUDGET_RUNS * self.clock.seconds.get("runs", 0))
        return None if chosen == math.inf else chosen

    def _isolation(self) -> None:
        self.isolation.run(suite_run_s=self.suite_runs.mean_wall)
        self.suite_runs.write_state()

    def _parallel(self) -> None:
        """Collisions first; once one is confirmed, later replays run one at a time (two
        replays at once would collide the same way, and a search would chase that)."""
        self.parallel.run()
        if self.parallel.collided:
            self.host.one_at_a_time = True

    # -- verdicts and reports ------------------------------------------------
    def verdicts(self, *, stopped: bool = False) -> list[TestVerdict]:
        """One verdict per test. A collected test no process reached gets one too ("never
        ran"), unless the sweep was `stopped` short: then a note counts them instead."""
        replays_dir = self.options.out / "replays"
        store = self.store
        tests = []
        runs = len(store.run_ids)
        if self.no_searches:  # a shard, or `merge --no-run`: what needs a search is unverified
            for job in self.searches.jobs():
                store.ev(job[-1]).budget_cut = True
        ran = {nodeid for nodeid, ev in store.evidence.items() if ev.ran}
        unreached = [n for n in store.collected if n not in ran]
        if stopped and unreached:
            store.note(f"{len(unreached)} of {len(store.collected)} collected tests had "
                       "not run when the sweep stopped")  # fmt: skip
        elif unreached:
            for nodeid in unreached:
                store.ev(nodeid)
            self._note_unmatched_ids(unreached, ran - set(store.collected))
        for nodeid in sorted(store.evidence):
            ev = store.evidence[nodeid]
            verdict = catalogue.classify(ev)
            replay = ""
            if verdict not in (Verdict.PASS, Verdict.ERROR):
                sequence = (
                    [*ev.polluters, nodeid] if verdict == Verdict.ORDER_DEPENDENT else [nodeid]
                )
                replay_file = replays_dir / f"{slug(nodeid)}.txt"
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
                cleaners=ev.cleaners, fix=self.fixes.verdict_fields(nodeid),
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
        if note not in self.store.notes:
            self.store.note(note)

    def _finish(self, interrupted: bool) -> SweepResult:
        o = self.options
        out = o.out
        store = self.store
        tests = self.verdicts(stopped=interrupted or bool(self.neighbors_problem))
        store.close_records()
        read = store.report
        summary = Summary(
            runs=len(store.run_ids), workers=o.workers, seeds=store.seeds,
            shuffles=store.shuffles, backend=backend_probe.backend_in_tests(),
            duration_s=round(time.monotonic() - self.started, 3), tests=tests,
            counts={c: sum(t.classification == c for t in tests) for c in catalogue.CLASSES},
            searches=store.searches, notes=store.notes, ddmin_cap=search.DDMIN_CAP,
            verify_times=VERIFY_TIMES,
            phase_times=phase_times.summary_times(self.clock, self.raw, read.phase_rows()),
            shard="" if o.shard is None else str(o.shard), suite_errors=store.suite_errors,
            timeout=self.runner.timeout_line(),
            interrupted=self.stopped,
            fixes=[self.fixes.records[n] for n in sorted(self.fixes.records)],
        )  # fmt: skip
        summary.outcomes = _not_passed(tests, read.worst())
        summary.placement = placement.placement_section(read.pinned)
        summary.gpu = gpu_report.gpu_section(
            [t.__dict__ for t in tests], read.flagged, capture_sweep.neighbor_summary(self.raw)
        )
        past = self._history(tests) if o.shard is None else []  # the merge writes the history
        self.suite_runs.write_state()
        table = write_reports(out, summary, read, self._grid(), store.run_ids, past)
        self._ci_outputs(summary, table)
        if self.neighbors_problem:
            return SweepResult(summary, EXIT_USAGE, f"{self.neighbors_problem}; report: {out}")
        if o.shard is not None and store.collected and not interrupted:
            mine = len(self.suite_runs.numbers())
            done = (f"done ({mine} runs, {len(store.alone_done)} alone reruns); verdicts come "
                    "from `capsafe merge OUT` over every shard's --out"
                    if len(store.runs_done) == mine else f"stopped after {len(store.runs_done)} "
                    f"of its {mine} runs: `--resume` it before `capsafe merge`")  # fmt: skip
            where = f"partial report: {out / 'report.html'}"
            return SweepResult(summary, EXIT_OK, f"shard {o.shard} {done}; {where}")
        return _outcome(summary, o.baseline, interrupted, out, bool(store.collected))

    def _ci_outputs(self, summary: Summary, table: Sequence[Mapping[str, Any]]) -> None:
        """--junitxml, and under GitHub Actions the annotations and job summary (a shard's
        partial view gets none: the merge's verdicts are the ones to show)."""
        o = self.options
        tests = worst_first(table)
        try:
            if o.junitxml is not None:
                junit.write_junit(o.junitxml, summary, tests, o.baseline)
            if o.shard is None:
                report_md = (o.out / "report.md").read_text(encoding="utf-8")
                github.write_actions_output(tests, self.runner.lines, self.runner.rootdir,
                                            report_md, o.baseline)  # fmt: skip
        except OSError as exc:  # the reports are written: say so, and carry on to the verdict
            print(f"capsafe sweep: CI output not written: {describe_error(exc)}", file=sys.stderr)

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
            self.store.note(f"{out.parent / history.LATEST} not updated: {describe_error(exc)}")
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
                self.store.note(f"{exc}; moved to {aside.name}, history starts afresh")
                return history.append_history(path, sweep_id, stamp, verdicts, suite=suite)
        except (OSError, history.HistoryError) as exc:
            self.store.note(f"{path} not updated: {describe_error(exc)}")
            return []

    def _grid(self) -> dict[str, list[str]]:
        grid: dict[str, list[str]] = {}
        for nodeid in self.store.evidence:
            states = []
            for run_id in self.store.run_ids:
                a = self.store.run_attempts.get((run_id, nodeid))
                states.append(Cell.NOT_RUN if a is None else _cell(a))
            grid[nodeid] = states
        return grid


def _not_passed(tests: Sequence[TestVerdict], worst: Mapping[str, Outcome]) -> dict[str, int]:
    """The tests classed pass by their outcome other than passed (`worst`: each test's first
    of OUTCOMES among its attempts, as the per-test table says): skipped, xfailed, xpassed."""
    found = Counter(
        worst.get(t.nodeid, "passed") for t in tests if t.classification == Verdict.PASS
    )
    return {o: n for o, n in found.items() if o != "passed"}


def _cell(attempt: fold.Attempt) -> str:
    if not attempt.failed:
        return Cell.PASSED
    if Signal.CRASH in attempt.signals:
        return Cell.CRASH
    if Signal.TIMEOUT in attempt.signals:
        return Cell.TIMEOUT
    return Cell.FAILED


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
    suite = suite_errors_text(summary.suite_errors, summary.runs)
    if found:
        by_class = Counter(t.classification for t in found)
        kinds = ", ".join(f"{by_class[c]} {c}" for c in catalogue.CLASSES if by_class[c])
        also = f"; {suite}" if suite else ""
        return SweepResult(summary, EXIT_FOUND,
                           f"{len(found)} not passing ({kinds}){also}; {where}")  # fmt: skip
    extra = f" ({quarantined} quarantined by the baseline)" if quarantined else ""
    passing = passing_phrase(len(summary.tests), summary.outcomes) + extra
    if suite:
        return SweepResult(summary, EXIT_FOUND, f"{passing}, but {suite}; {where}")
    return SweepResult(summary, EXIT_OK, f"{passing}; {where}")
