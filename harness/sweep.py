"""`capsafe sweep`: run a suite many ways, explain every failure, write the report.

Phases, each a set of pytest subprocesses driven through the capsafe plugin:
1. runs: the whole suite N times under xdist, a different seed (order) each;
2. isolation: every test that ever failed, alone, in R fresh processes;
3. searches: for a test that fails in the suite but never alone, replay what ran
   before it in its process to find the polluter; for one that fails alone but
   passed in the suite, find the state-setter (harness.search);
4. classification and reports (harness.classify, harness.report, harness.history).

Every subprocess runs in its own session under a stall watchdog: one that
writes nothing for `stall_s` seconds is killed and the test it was in is
recorded as timed out, so a hang never stops the sweep. Ctrl-C and an
exhausted --budget both stop new work and still write the report.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import classify as cl
from . import history, order, report, search, stats
from .records import Record, load_records

SWEEP_TMP_ENV = "CAPSAFE_SWEEP_TMP"
"""Set for every test process: a fresh empty directory of its own, removed afterwards."""
SWEEP_SHARED_ENV = "CAPSAFE_SWEEP_SHARED"
"""Set for every test process: one directory shared by all processes of this sweep.

For suites that keep state across processes on purpose (the planted flaky suite
counts its invocations there, so its nondeterminism is the same in every sweep).
"""

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
PYTEST_NO_RUN = (2, 3, 4, 5)  # interrupted, internal error, usage error, no tests collected
MAX_PREFIXES = 2  # failing (or passing) runs whose prefix a search tries before widening


class _BudgetSpent(Exception):
    """Raised inside a search when --budget runs out between two replays."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while a test process ran: carries what that process finished before it died."""

    def __init__(self, result: ProcessResult) -> None:
        super().__init__()
        self.result = result


class SweepError(Exception):
    """The sweep cannot start or the suite cannot be run at all: a usage error (exit 2)."""


@dataclass(frozen=True)
class SweepOptions:
    """Everything `capsafe sweep` was asked to do. Paths are absolute."""

    paths: tuple[Path, ...]
    out: Path
    seed: int
    runs: int = 5
    workers: int = 2
    timeout: float = 60.0
    isolation_runs: int = 3
    neighbors: int = 0
    threads: int = 1
    budget: float | None = None
    baseline: frozenset[str] = frozenset()
    pytest_args: tuple[str, ...] = ()
    stall_s: float | None = None  # None: 2 x timeout + 30 s
    progress: bool = True

    @property
    def stall_limit(self) -> float:
        return self.stall_s if self.stall_s is not None else 2 * self.timeout + 30


@dataclass
class ProcessResult:
    """One pytest subprocess: its exit code, rows, and whether the watchdog killed it."""

    label: str
    returncode: int
    rows: list[Record]
    stalled: bool
    log: Path
    malformed: int = 0  # record lines that could not be read (skipped, counted in the notes)


@dataclass
class SweepResult:
    summary: dict[str, Any]
    exit_code: int
    reason: str


@dataclass
class _Evidence:
    """What the sweep learned about one test, filled in phase by phase."""

    nodeid: str
    runs: int = 0
    failures: int = 0
    isolation_runs: int = 0
    isolation_failures: int = 0
    polluters: list[str] = field(default_factory=list)
    state_setters: list[str] = field(default_factory=list)
    signals: set[str] = field(default_factory=set)


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


def suite_root(paths: Sequence[Path]) -> Path:
    """Where pytest runs: the common parent of the paths, so the suite's own ini applies."""
    if not paths:
        return Path.cwd()
    common = Path(os.path.commonpath([str(p) for p in paths]))
    return common if common.is_dir() else common.parent


class Runner:
    """Starts pytest subprocesses for one sweep and can kill all of them at once."""

    def __init__(self, options: SweepOptions, raw: Path) -> None:
        self.options = options
        self.raw = raw
        self.shared = raw / "shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.cwd = suite_root(options.paths)
        self.stopping = threading.Event()
        self._live: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    # -- commands -------------------------------------------------------------
    def targets(self) -> list[str]:
        return [os.path.relpath(p, self.cwd) for p in self.options.paths]

    def replay_targets(self, nodeids: Iterable[str]) -> list[str]:
        """The files holding `nodeids`, so a replay collects only those (else every path)."""
        files: list[str] = []
        for nodeid in nodeids:
            part = nodeid.split("::", 1)[0]
            found = next(
                (b / part for b in (self.cwd, *self.cwd.parents) if (b / part).exists()), None
            )
            if found is None:
                return self.targets()
            rel = os.path.relpath(found, self.cwd)
            if rel not in files:
                files.append(rel)
        return files

    def pytest_command(
        self,
        targets: Sequence[str],
        records: Path | None,
        run_id: str | None,
        *,
        seed: int | None,
        workers: int,
        replay_file: Path | None = None,
    ) -> list[str]:
        o = self.options
        cmd = [sys.executable, "-m", "pytest", *targets, "-p", "capsafe"]
        if records is not None:
            cmd += ["--capsafe-records", str(records), "--capsafe-run-id", str(run_id)]
        if replay_file is not None:
            cmd += ["--capsafe-replay", str(replay_file)]
        elif seed is not None:
            cmd += ["--capsafe-shuffle", "global"]
        if seed is not None:
            cmd += ["--capsafe-seed", str(seed)]
        cmd += ["-n", str(workers)] if workers else ["-p", "no:xdist"]
        cmd += ["--timeout", f"{o.timeout:g}", "--timeout-method", "signal"]
        if o.neighbors:
            cmd += ["--capsafe-neighbors", str(o.neighbors)]
        if o.threads > 1:
            cmd += ["--parallel-threads", str(o.threads)]
        return [*cmd, "-q", "-p", "no:cacheprovider", *o.pytest_args]

    def replay_command(self, replay_file: Path, nodeids: Sequence[str]) -> str:
        """A shell line a person can paste to see the failure again."""
        cmd = self.pytest_command(
            self.replay_targets(nodeids), None, None, seed=None, workers=0,
            replay_file=replay_file,
        )  # fmt: skip
        return f"cd {shlex.quote(str(self.cwd))} && {shlex.join(cmd)}"

    # -- processes ------------------------------------------------------------
    def run(self, label: str, cmd: list[str]) -> ProcessResult:
        """Run one pytest process to completion (or stall, or stop) and read its rows."""
        records = self.raw / label
        records.mkdir(parents=True, exist_ok=True)
        log = self.raw / f"{label}.log"
        scratch = tempfile.mkdtemp(prefix=f"capsafe-{label}-")
        env = {**os.environ, SWEEP_TMP_ENV: scratch, SWEEP_SHARED_ENV: str(self.shared)}
        stalled = interrupted = False
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    cmd, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
                with self._lock:
                    self._live.add(proc)
                try:
                    stalled = self._watch(proc, records, log)
                except KeyboardInterrupt:
                    _kill(proc)
                    interrupted = True
                except BaseException:  # never leave a test process behind
                    _kill(proc)
                    raise
                finally:
                    with self._lock:
                        self._live.discard(proc)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        rows, malformed = load_records(records)
        if interrupted:
            raise Interrupted(
                ProcessResult(label, proc.returncode, cl.finished_rows(rows), False, log, malformed)
            )
        stall = self.options.stall_limit if stalled else None
        rows += cl.unfinished_rows(rows, stalled_after=stall)
        return ProcessResult(label, proc.returncode, rows, stalled, log, malformed)

    def _watch(self, proc: subprocess.Popen[bytes], records: Path, log: Path) -> bool:
        last, changed = -1, time.monotonic()
        while True:
            try:
                proc.wait(timeout=0.05)
                return False
            except subprocess.TimeoutExpired:
                pass
            if self.stopping.is_set():
                raise KeyboardInterrupt
            size = _size(records) + _size(log)
            now = time.monotonic()
            if size != last:
                last, changed = size, now
            elif now - changed > self.options.stall_limit:
                _kill(proc)
                return True

    def kill_all(self) -> None:
        self.stopping.set()
        with self._lock:
            live = list(self._live)
        for proc in live:
            _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(_size(p) for p in path.iterdir())
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Sweep:
    """One sweep: holds the evidence as phases add to it, so an interruption can still report."""

    def __init__(self, options: SweepOptions) -> None:
        self.options = options
        self.started = time.monotonic()
        self.raw = options.out / "raw"
        self.runner = Runner(options, self.raw)
        self.rows: list[Record] = []
        self.run_ids: list[str] = []
        self.seeds: list[int] = []
        self.run_attempts: dict[tuple[str, str], cl.Attempt] = {}
        self.evidence: dict[str, _Evidence] = {}
        self.searches: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._labels = 0
        self._label_lock = threading.Lock()

    # -- driver ---------------------------------------------------------------
    def execute(self) -> SweepResult:
        interrupted = False
        try:
            self._runs()
            self._isolation()
            self._searches()
        except KeyboardInterrupt:
            interrupted = True
            self.runner.kill_all()
            self.notes.append("interrupted (Ctrl-C): the report covers what ran before it")
        return self._finish(interrupted)

    def _budget_left(self) -> bool:
        budget = self.options.budget
        return budget is None or time.monotonic() - self.started < budget

    def _skip_for_budget(self, what: str, count: int) -> None:
        if count:
            self.notes.append(f"budget of {self.options.budget:g}s spent: skipped {count} {what}")

    def _label(self, kind: str) -> str:
        with self._label_lock:
            self._labels += 1
            return f"{kind}-{self._labels}"

    def _bar(self, total: int, desc: str):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=desc.split()[-1], file=sys.stderr,
                    disable=not self.options.progress or total == 0, leave=False)  # fmt: skip

    # -- phase 1: runs --------------------------------------------------------
    def _runs(self) -> None:
        o = self.options
        seeds = run_seeds(o.seed, o.runs)
        with self._bar(o.runs, "suite runs") as bar:
            for k, seed in enumerate(seeds, start=1):
                if k > 1 and not self._budget_left():
                    self._skip_for_budget("suite runs", o.runs - k + 1)
                    break
                run_id = f"run-{k}"
                cmd = self.runner.pytest_command(
                    self.runner.targets(), self.raw / run_id, run_id, seed=seed,
                    workers=o.workers,
                )  # fmt: skip
                try:
                    result = self.runner.run(run_id, cmd)
                except Interrupted as stop:
                    self._add_run(run_id, seed, stop.result)
                    raise
                self._check_ran(result)
                self._add_run(run_id, seed, result)
                bar.update()

    def _add_run(self, run_id: str, seed: int, result: ProcessResult) -> None:
        self.run_ids.append(run_id)
        self.seeds.append(seed)
        self._take(result)
        found = cl.attempts(result.rows)
        self.run_attempts.update(found)
        for attempt in found.values():
            ev = self._ev(attempt.nodeid)
            ev.runs += 1
            ev.failures += attempt.failed
            ev.signals |= attempt.signals

    def _check_ran(self, result: ProcessResult) -> None:
        if result.rows or result.stalled or result.returncode not in PYTEST_NO_RUN:
            return
        if result.returncode == 5:
            detail = "no tests were collected"
        else:
            detail = _last_line(result.log) or f"see {result.log}"
        raise SweepError(f"pytest could not run the suite (exit {result.returncode}): {detail}")

    def _take(self, result: ProcessResult) -> None:
        self.rows += result.rows
        if result.malformed:
            self.notes.append(
                f"{result.label}: skipped {result.malformed} malformed record line(s) "
                f"in {self.raw / result.label}"
            )
        if result.stalled:
            self.notes.append(
                f"{result.label}: no progress for {self.options.stall_limit:g}s; the process "
                "was killed and the test it was in recorded as timed out"
            )

    def _ev(self, nodeid: str) -> _Evidence:
        return self.evidence.setdefault(nodeid, _Evidence(nodeid))

    # -- phase 2: isolation ---------------------------------------------------
    def _isolation(self) -> None:
        failing = sorted(n for n, ev in self.evidence.items() if ev.failures)
        jobs = [(n, i) for n in failing for i in range(self.options.isolation_runs)]
        seeds = run_seeds(self.options.seed, len(jobs), kind="alone")

        def alone(job: tuple[str, int], i: int) -> tuple[str, bool | None, frozenset[str]]:
            failed, signals = self._replay([], job[0], seeds[i], "alone")
            return job[0], failed, signals

        for nodeid, failed, signals in self._pool("isolation reruns", jobs, alone):
            ev = self._ev(nodeid)
            if failed is None:
                self.notes.append(f"{nodeid}: did not run alone (see the alone-*.log files)")
                continue
            ev.isolation_runs += 1
            ev.isolation_failures += failed
            ev.signals |= signals

    # -- phase 3: searches ----------------------------------------------------
    def _searches(self) -> None:
        jobs: list[tuple[str, str]] = []
        for nodeid, ev in sorted(self.evidence.items()):
            if not ev.failures or not ev.isolation_runs:
                continue
            if ev.isolation_failures == 0:
                jobs.append(("polluter", nodeid))
            elif ev.isolation_failures == ev.isolation_runs:
                jobs.append(("state-setter", nodeid))
        for kind, nodeid, found, record in self._pool(
            "cause searches", jobs, lambda job, _: self._search(*job)
        ):
            self.searches.append(record)
            target = self._ev(nodeid)
            if kind == "polluter":
                target.polluters = list(found)
            else:
                target.state_setters = list(found)

    def _search(self, kind: str, nodeid: str) -> tuple[str, str, tuple[str, ...], dict[str, Any]]:
        """Try the prefixes most likely to hold the cause, stop at the first that reproduces."""
        want_failed = kind == "polluter"
        tried: list[list[str]] = []
        replays, candidates = 0, 0
        for seed, prefix in self._prefixes(nodeid, want_failed):
            if prefix in tried or not prefix:
                continue
            tried.append(prefix)

            def oracle(tests: Sequence[str], seed: int | None = seed) -> bool:
                if not self._budget_left():
                    raise _BudgetSpent
                failed, _ = self._replay(list(tests), nodeid, seed, "replay")
                return failed is want_failed

            try:
                result = search.search(nodeid, prefix, oracle)
            except _BudgetSpent:
                self.notes.append(f"budget spent during the {kind} search for {nodeid}")
                break
            replays += result.replays
            candidates = result.candidates
            if result.reproduced:
                return kind, nodeid, result.culprits, _search_record(nodeid, candidates, replays)
        return kind, nodeid, (), _search_record(nodeid, candidates, replays)

    def _prefixes(self, nodeid: str, want_failed: bool) -> Iterable[tuple[int | None, list[str]]]:
        """(seed, candidates) to search, best first: the test's own process in runs where it
        did what we explain, then everything that ran before it in that run, then (for a
        state-setter never seen passing) every test that passed somewhere."""
        mine = [
            a for a in self.run_attempts.values() if a.nodeid == nodeid and a.failed is want_failed
        ]
        mine.sort(key=lambda a: self.run_ids.index(a.run_id))
        for attempt in mine[:MAX_PREFIXES]:
            yield attempt.seed, cl.process_sequence(self.run_attempts, attempt)
        for attempt in mine[:1]:
            yield attempt.seed, cl.run_sequence(self.run_attempts, attempt)
        if not want_failed and not mine:
            passed = sorted(
                (a for a in self.run_attempts.values() if not a.failed and a.nodeid != nodeid),
                key=lambda a: (self.run_ids.index(a.run_id), a.start),
            )
            yield (
                (self.seeds[0] if self.seeds else None),
                list(dict.fromkeys(a.nodeid for a in passed)),
            )

    # -- replays --------------------------------------------------------------
    def _replay(
        self, before: list[str], target: str, seed: int | None, kind: str
    ) -> tuple[bool | None, frozenset[str]]:
        """Run `before` then `target` in one fresh process. (target failed?, its signals);
        failed is None when the target did not run at all (not collected, usage error)."""
        if self.runner.stopping.is_set():
            raise KeyboardInterrupt
        label = self._label(kind)
        sequence = [*before, target]
        replay_file = self.raw / "replays" / f"{label}.txt"
        order.write_replay(replay_file, sequence)
        cmd = self.runner.pytest_command(
            self.runner.replay_targets(sequence), self.raw / label, label, seed=seed,
            workers=0, replay_file=replay_file,
        )  # fmt: skip
        result = self.runner.run(label, cmd)
        with self._label_lock:
            self._take(result)
        attempt = cl.attempts(result.rows).get((label, target))
        if attempt is not None:
            return attempt.failed, attempt.signals
        if result.returncode in PYTEST_NO_RUN:
            return None, frozenset()
        # The process died before the target reported anything: it crashed in it.
        return True, frozenset({"crash"})

    def _pool(
        self, desc: str, jobs: Sequence[Any], work: Callable[[Any, int], Any]
    ) -> Iterable[Any]:
        """Run jobs on up to `workers` threads (each drives one subprocess), yielding results
        as they finish; stops starting jobs when the budget is spent."""
        if not jobs:
            return
        # Reruns are single-process: without xdist still use a few cores for them.
        width = self.options.workers or min(4, os.cpu_count() or 1)
        skipped = 0
        with (
            self._bar(len(jobs), desc) as bar,
            concurrent.futures.ThreadPoolExecutor(width) as pool,
        ):
            pending: set[concurrent.futures.Future[Any]] = set()
            queue = list(enumerate(jobs))
            try:
                while queue or pending:
                    while queue and len(pending) < width:
                        if not self._budget_left():
                            skipped, queue = len(queue), []
                            break
                        i, job = queue.pop(0)
                        pending.add(pool.submit(work, job, i))
                    if not pending:
                        break
                    done, pending = concurrent.futures.wait(
                        pending, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    for future in done:
                        bar.update()
                        yield future.result()
            except BaseException:
                self.runner.kill_all()
                for future in pending:
                    future.cancel()
                raise
        self._skip_for_budget(desc, skipped)

    # -- phase 4: verdicts and reports ----------------------------------------
    def _finish(self, interrupted: bool) -> SweepResult:
        o = self.options
        out = o.out
        replays_dir = out / "replays"
        tests = []
        for nodeid in sorted(self.evidence):
            ev = self.evidence[nodeid]
            verdict = cl.classify(
                failures=ev.failures, isolation_runs=ev.isolation_runs,
                isolation_failures=ev.isolation_failures, polluters=ev.polluters,
                state_setters=ev.state_setters,
            )  # fmt: skip
            replay = ""
            if verdict != "pass":
                sequence = [*ev.polluters, nodeid] if verdict == "order-dependent" else [nodeid]
                replay_file = replays_dir / f"{_slug(nodeid)}.txt"
                order.write_replay(replay_file, sequence)
                replay = self.runner.replay_command(replay_file.resolve(), sequence)
            low, high = stats.wilson_interval(ev.failures, ev.runs)
            tests.append({
                "nodeid": nodeid,
                "classification": verdict,
                "runs": ev.runs,
                "failures": ev.failures,
                "flake_rate": round(stats.flake_rate(ev.failures, ev.runs), 6),
                "flake_rate_ci": [round(low, 6), round(high, 6)],
                "isolation_runs": ev.isolation_runs,
                "isolation_failures": ev.isolation_failures,
                "polluters": ev.polluters,
                "state_setters": ev.state_setters,
                "signals": sorted(ev.signals),
                "replay": replay,
            })  # fmt: skip
        counts = {c: sum(t["classification"] == c for t in tests) for c in cl.CLASSES}
        summary: dict[str, Any] = {
            "runs": len(self.run_ids),
            "workers": o.workers,
            "seeds": self.seeds,
            "backend": requested_backend(),
            "duration_s": round(time.monotonic() - self.started, 3),
            "tests": tests,
            "counts": counts,
            "searches": self.searches,
            "notes": self.notes,
        }
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        verdicts = [
            history.Verdict(t["nodeid"], t["classification"], t["runs"], t["failures"],
                            t["flake_rate"])
            for t in tests
        ]  # fmt: skip
        past = self._append_history(out.parent / history.HISTORY_FILE, out.name, stamp, verdicts)
        try:
            history.point_latest(out)
        except OSError as exc:
            self.notes.append(f"{out.parent / history.LATEST} not updated: {describe_error(exc)}")
        report.write_reports(out, summary, self.rows, self._grid(), self.run_ids, past)
        return _outcome(summary, o.baseline, interrupted, out)

    def _append_history(
        self, path: Path, sweep_id: str, stamp: str, verdicts: list[history.Verdict]
    ) -> list[dict[str, str]]:
        """Append to history.csv; one that is not a history file is set aside, never lost,
        and a history that cannot be written is a note, not a lost report."""
        try:
            try:
                return history.append_history(path, sweep_id, stamp, verdicts)
            except history.HistoryError as exc:
                aside = history.set_aside(path)
                self.notes.append(f"{exc}; moved to {aside.name}, history starts afresh")
                return history.append_history(path, sweep_id, stamp, verdicts)
        except (OSError, history.HistoryError) as exc:
            self.notes.append(f"{path} not updated: {describe_error(exc)}")
            return []

    def _grid(self) -> dict[str, list[str]]:
        grid: dict[str, list[str]] = {}
        for nodeid in self.evidence:
            states = []
            for run_id in self.run_ids:
                a = self.run_attempts.get((run_id, nodeid))
                states.append("none" if a is None else _cell(a))
            grid[nodeid] = states
        return grid


def requested_backend() -> str:
    """CAPSAFE_BACKEND as the test processes inherit it (a suite's conftest may still pick
    another, as the planted capture suite does)."""
    return os.environ.get("CAPSAFE_BACKEND", "auto").strip().lower() or "auto"


def _cell(attempt: cl.Attempt) -> str:
    if not attempt.failed:
        return "pass"
    if "crash" in attempt.signals:
        return "crash"
    if "timeout" in attempt.signals:
        return "timeout"
    return "fail"


def _search_record(victim: str, candidates: int, replays: int) -> dict[str, Any]:
    return {"victim": victim, "candidates": candidates, "replays": replays}


def _slug(nodeid: str) -> str:
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:80]
    return f"{readable}-{hashlib.sha1(nodeid.encode()).hexdigest()[:8]}"


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _outcome(
    summary: dict[str, Any], baseline: frozenset[str], interrupted: bool, out: Path
) -> SweepResult:
    found = [
        t for t in summary["tests"]
        if t["classification"] != "pass" and t["nodeid"] not in baseline
    ]  # fmt: skip
    quarantined = sum(
        t["classification"] != "pass" and t["nodeid"] in baseline for t in summary["tests"]
    )
    where = f"report: {out / 'report.html'}"
    if interrupted:
        return SweepResult(summary, EXIT_INTERRUPTED, f"interrupted; partial {where}")
    if found:
        by_class = Counter(t["classification"] for t in found)
        kinds = ", ".join(f"{by_class[c]} {c}" for c in cl.CLASSES if by_class[c])
        return SweepResult(summary, EXIT_FOUND, f"{len(found)} not passing ({kinds}); {where}")
    extra = f" ({quarantined} quarantined by the baseline)" if quarantined else ""
    return SweepResult(summary, EXIT_OK, f"all {len(summary['tests'])} tests pass{extra}; {where}")


def read_baseline(path: str | os.PathLike[str]) -> frozenset[str]:
    """Quarantined node ids: a replay-style list whose lines may also end in ' # comment'."""
    ids = (line.split(" #", 1)[0].strip() for line in order.read_replay(path))
    return frozenset(nodeid for nodeid in ids if nodeid)


def describe_error(exc: BaseException) -> str:
    """The reason alone ("Permission denied"), for a one-line message that names the path."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def prepare_out(out: Path) -> None:
    """Create the report directory and prove it writable now, not after an hour of runs;
    SweepError with the reason otherwise."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise SweepError(f"cannot write reports into --out {out}: {describe_error(exc)}") from None


def run_sweep(options: SweepOptions) -> SweepResult:
    """Run one whole sweep and write its reports into options.out."""
    prepare_out(options.out)
    return Sweep(options).execute()
