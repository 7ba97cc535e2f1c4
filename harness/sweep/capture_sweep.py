"""The sweep's capture-safety part: the `capture-unsafe` evidence, its isolation reruns and
the hazard attribution, for a sweep run with `--neighbors`.

A test is capture-unsafe when it failed with a capture error (harness.plugin.capture_errors)
in some process that had neighbour threads, and passed in every process without
them (at least one). The sweep gets that control evidence itself: isolation
reruns alternate without and with neighbours. Such a failure is caused by the
neighbours, not by another test, so capture-unsafe tests never go to a polluter
or state-setter search; instead each goes to attribution (harness.verdicts.attribution).

Process counts are what a GPU suite's sweep costs (each pytest process imports the
framework and initializes CUDA), so the reruns of the tests that failed with a
capture error are batched: one process runs all of them, in a seeded order, per
isolation rerun. The evidence rule allows it: a pass without neighbours is a pass
whatever else ran in the process, and a test whose control run fails there gets
the ordinary alone reruns. Attribution processes likewise run all undecided
tests at once, and the processes of one step run in parallel up to --workers.

Last, every capture-unsafe test is rerun beside the same neighbours with
`--capsafe-protect=FRAMEWORKS` (`--protect`: `auto`, the integrations of the frameworks
the capture-unsafe tests captured through, or where none of those has one, of every
framework the suite's interpreter finds; `none`; or names), R times, batched by the same rule:
a test that passes every batched rerun survived; one that failed in a batch gets R
alone reruns, and those decide (report.protection.ProtectedRuns holds the verdict).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..plugin import neighbors as nb
from ..plugin.protect import FRAMEWORKS
from ..plugin.protect import OPTION as PROTECT_OPTION
from ..records import Signal
from ..report.protection import ProtectedRuns
from ..verdicts import attribution as attr
from ..verdicts.evidence import CaptureEvidence, Evidence
from ..verdicts.fold import Attempt
from .host import Host
from .options import SweepError

NEIGHBOR_CALLS_OPTION = "--capsafe-neighbor-calls"
AUTO, NO_PROTECTION = "auto", "none"  # the `--protect` choices besides integration names


class NeighborsDidNotStart(Exception):
    """Neighbour threads could not start in a test process: the sweep stops (exit 2)."""


def batch(
    host: Host, tests: Sequence[str], *, neighbors: bool, calls: Sequence[str],
    seed: int | None, kind: str, protect: Sequence[str] = (),
) -> dict[str, Attempt]:  # fmt: skip
    """Run `tests` in this order in one fresh process, with neighbours or not (limited to
    `calls` kinds), with `--capsafe-protect` when `protect` names integrations; their
    attempts by node id."""
    extra = neighbor_args(neighbors, calls)
    if protect:
        extra += (f"{PROTECT_OPTION}={','.join(protect)}",)
    done = host.replay(tests, seed=seed, kind=kind, extra=extra)
    if protect and not done.ran:  # e.g. an integration that cannot install there
        host.note(f"{done.label}: the protected rerun ran no test (pytest exit "
                  f"{done.returncode}; see {done.log})")  # fmt: skip
    return done.attempts


def capture_failure(attempt: Attempt) -> bool:
    """Failed inside one of its own capture windows (the observer's evidence; whatever the
    library called the error)."""
    return attempt.failed and Signal.FAILED_IN_CAPTURE in attempt.signals


ATTRIBUTION_REPEATS = 3
"""Times an attribution process of the first round runs each of its tests, one after
another, doubled in each later round: a neighbour call breaks a capture only when it lands
in the window, and CuPy's test_stream_is_capturing captures one multiply (H200: no kind
alone broke it in three rounds of one try each, while all kinds together broke it in 2 of 4
runs); with 3 tries in every round, test_stream_fork_join[True] came out "no single call
kind" in one of two sweeps and `ctx_sync` in the other (2026-12-03). A test a later round
still runs is one no kind broke yet, so the repetitions cost its test time, not a process."""


def attribute(
    host: Host, kinds: Sequence[str], targets: Sequence[str], seed: int | None, round_: int = 1
) -> attr.Outcomes:
    """One attribution process of round `round_`: `targets`, each ATTRIBUTION_REPEATS times
    (doubled per round after the first), beside neighbours making only `kinds`; per target
    whether it broke."""
    repeats = ATTRIBUTION_REPEATS << (round_ - 1)
    repeated = [n for n in targets for _ in range(repeats)]
    found = batch(host, repeated, neighbors=True, calls=kinds, seed=seed, kind="attrib")
    return _outcomes(targets, found)


def _attribution_jobs(
    group: attr.GroupTest, host: Host, payload: tuple[attr.Job, int], seed: int | None
) -> list[tuple[str, Any]]:
    """Run one attribution process (its job and round); the pool jobs it calls for next,
    each with its round (read as `record` returns them: a round ends only once every
    process of it is recorded, so the jobs it returns are of the round it leaves set)."""
    (kinds, targets), round_ = payload
    follow = group.record(kinds, attribute(host, kinds, targets, seed, round_))
    return [("attrib", (j, group.rounds)) for j in follow]


def _outcomes(tests: Sequence[str], found: dict[str, Attempt]) -> attr.Outcomes:
    """Per test of an attribution process: broke (failed inside its own capture window),
    survived (passed), or no evidence (did not run, or failed some other way). A failure
    after another test of the process left a GLOBAL capture open is no evidence either:
    that capture, not this kind of call, may be what its own capture ran into. One left
    open in another mode fails only other threads' synchronizing calls (the H200's
    left-open rows): new captures on other streams begin and end beside it."""
    outcomes: attr.Outcomes = dict.fromkeys(tests)
    leaked = False
    for attempt in sorted(found.values(), key=lambda a: a.index):
        if attempt.nodeid in outcomes:
            broke = capture_failure(attempt) and not leaked
            outcomes[attempt.nodeid] = True if broke else None if attempt.failed else False
        leaked = leaked or attempt.left_global_open
    return outcomes


class CapturePhases:
    """The capture evidence of one sweep, the batched reruns and the attribution."""

    def __init__(
        self, neighbors: int, calls: Sequence[str] = (), store: dict[str, Evidence] | None = None
    ) -> None:
        """`store`: the sweep's one evidence store, whose `capture` parts these phases fill."""
        self.neighbors = neighbors
        self.calls = tuple(calls) or (nb.issued_calls() if neighbors else ())
        self.store: dict[str, Evidence] = {} if store is None else store
        self.attributions: dict[str, attr.Attribution] = {}
        self.attribution_processes = 0
        self.protection: dict[str, ProtectedRuns] = {}
        self._lock = threading.Lock()

    def _of(self, nodeid: str) -> CaptureEvidence:
        return self.store.setdefault(nodeid, Evidence(nodeid)).capture

    def saw(self, attempt: Attempt, *, neighbors: bool, batched: bool = False) -> None:
        """Count one attempt, from a process with or without neighbour threads, with where
        its captures were."""
        self._count(attempt.nodeid, attempt.failed, attempt.signals, neighbors, batched)
        with self._lock:
            ev = self.store.setdefault(attempt.nodeid, Evidence(attempt.nodeid))
            ev.capture_sites += [s for s in dict.fromkeys(attempt.capture_sites)
                                 if s not in ev.capture_sites]  # fmt: skip
            ev.capture_frameworks.update(attempt.capture_frameworks)
            ev.leak_failures += attempt.leak_victim
            ev.other_failures += attempt.failed and not attempt.leak_victim
            if attempt.thread_unsafe is not None:
                ev.thread_unsafe = attempt.thread_unsafe

    def _count(
        self, nodeid: str, failed: bool, signals: Iterable[str], neighbors: bool, batched: bool
    ) -> None:
        with self._lock:
            ev = self._of(nodeid)
            if neighbors:
                ev.neighbor_runs += 1
                ev.neighbor_failures += failed
                ev.capture_failures += failed and Signal.FAILED_IN_CAPTURE in signals
            elif batched:
                ev.batch_control_passes += not failed
                ev.batch_control_failures += failed
            else:
                ev.control_runs += 1
                ev.control_failures += failed

    def capture_unsafe(self, nodeid: str) -> bool:
        found = self.store.get(nodeid)
        return found is not None and found.capture_unsafe

    # -- isolation --------------------------------------------------------------
    @staticmethod
    def rerun_with_neighbors(k: int) -> bool:
        """Isolation rerun k (0-based) alternates: without neighbours first (the control)."""
        return k % 2 == 1

    def alone_args(self) -> list[tuple[str, ...]]:
        """Extra pytest options of alone rerun k, by k modulo their count."""
        if not self.neighbors:
            return [()]
        return [neighbor_args(self.rerun_with_neighbors(k)) for k in range(2)]

    def saw_alone(self, nodeid: str, failed: bool, signals: Iterable[str], rerun: int) -> None:
        """Count one alone rerun (its index says whether it had neighbours)."""
        if self.neighbors:
            self._count(nodeid, failed, signals, self.rerun_with_neighbors(rerun), False)

    def isolate(
        self, host: Host, failing: Sequence[str], runs: int, seeds: Sequence[int], seed: int
    ) -> list[str]:
        """Batched reruns of the failing tests that failed with a capture error (`runs`
        processes over all of them) and, on the same pool, their attribution (started at
        once for all of them; only the capture-unsafe ones are reported). Returns the
        tests that still need alone reruns."""
        suspects = [n for n in failing if self.neighbors and self._of(n).suspect]
        if not suspects:
            return list(failing)
        group = attr.GroupTest(suspects, self.calls)

        def work(job: tuple[str, Any], _: int) -> list[tuple[str, Any]]:
            kind, payload = job
            if kind == "batch":
                with_neighbors = self.rerun_with_neighbors(payload)
                found = batch(host, suspects, neighbors=with_neighbors, calls=(),
                              seed=seeds[payload], kind="batch")  # fmt: skip
                for attempt in found.values():
                    if attempt.nodeid in suspects:
                        self.saw(attempt, neighbors=with_neighbors, batched=True)
                return []
            return _attribution_jobs(group, host, payload, seed)

        jobs: list[tuple[str, Any]] = [("batch", k) for k in range(runs)]
        jobs += [("attrib", (j, group.rounds)) for j in group.start()]
        host.pool("capture reruns", jobs, work)
        self.attribution_processes = group.processes
        self.attributions = {t: group.result(t) for t in suspects if self.capture_unsafe(t)}
        return [n for n in failing if not self.capture_unsafe(n)]

    def attribute_late(self, host: Host, tests: Sequence[str], seed: int) -> None:
        """Attribution for the tests whose capture error showed only in an alone rerun
        with neighbours (their suite-run failures were something else), so every
        capture-unsafe test has its breaking calls named."""
        late = [n for n in tests if self.capture_unsafe(n) and n not in self.attributions]
        if not late:
            return
        group = attr.GroupTest(late, self.calls)

        def work(job: tuple[str, Any], _: int) -> list[tuple[str, Any]]:
            return _attribution_jobs(group, host, job[1], seed)

        host.pool("attribution", [("attrib", (j, group.rounds)) for j in group.start()], work)
        self.attribution_processes += group.processes
        self.attributions.update({t: group.result(t) for t in late})

    # -- protection -------------------------------------------------------------
    def _captured_through(self, tests: Iterable[str]) -> tuple[str, ...]:
        """The integrations for the frameworks `tests` captured through, as the capture
        observer saw them (`--protect auto`): a CuPy suite's reruns do not import torch
        because the machine has it (on the H200 that import was most of each protected
        rerun: 1.8-4.3 s against 0.5 s)."""
        seen = {f for t in tests for f in self.store[t].capture_frameworks}
        return tuple(n for n in FRAMEWORKS if n in seen)

    def protect(
        self, host: Host, choice: str, runs: int, seeds: Sequence[int], *,
        frameworks: Callable[[], tuple[str, ...]],
    ) -> None:  # fmt: skip
        """Rerun every capture-unsafe test with neighbours and `--capsafe-protect`, `runs`
        times, batched first (see the module doc); `choice` is the `--protect` value,
        `frameworks` what `auto` finds (find_frameworks)."""
        tests = sorted(n for n in list(self.store) if self.capture_unsafe(n))
        if not tests:
            return
        if choice == NO_PROTECTION:
            self.protection = {t: ProtectedRuns(not_run="--protect none") for t in tests}
            return
        chosen = self._captured_through(tests) if choice == AUTO else tuple(choice.split(","))
        if choice == AUTO and not chosen:
            chosen = frameworks()
        self.protection = {t: ProtectedRuns(chosen) for t in tests}
        if not chosen:
            return
        batch_passes = dict.fromkeys(tests, 0)

        def rerun(job: tuple[tuple[str, ...], int], _: int) -> list[Any]:
            targets, k = job
            found = batch(host, targets, neighbors=True, calls=(), seed=seeds[k],
                          kind="protect", protect=chosen)  # fmt: skip
            with self._lock:
                for attempt in found.values():
                    if len(targets) > 1:
                        batch_passes[attempt.nodeid] += not attempt.failed
                    elif attempt.nodeid in targets:
                        p = self.protection[attempt.nodeid]
                        p.runs += 1
                        p.failures += attempt.failed
                        p.capture_failures += capture_failure(attempt)
            return []

        if len(tests) > 1:
            host.pool("protected reruns", [(tuple(tests), k) for k in range(runs)], rerun)
        alone = [t for t in tests if len(tests) == 1 or batch_passes[t] < runs]
        for t in tests:
            if t not in alone:
                self.protection[t].runs = runs
        host.pool("protected reruns alone", [((t,), k) for t in alone for k in range(runs)],
                  rerun)  # fmt: skip

    # -- reporting --------------------------------------------------------------
    def _protected(self, nodeid: str) -> ProtectedRuns:
        return self.protection.get(nodeid) or ProtectedRuns(
            not_run="the sweep stopped before its protected reruns"
        )

    def _protection_line(self, nodeid: str) -> str:
        found = self.attributions.get(nodeid)
        return self._protected(nodeid).describe(found.breaks if found else ())

    def why(self, nodeid: str) -> str:
        """The evidence of a capture-unsafe verdict, in words."""
        ev = self._of(nodeid)
        control = ev.control_runs + ev.batch_control_passes + ev.batch_control_failures
        passed = control - ev.control_failures - ev.batch_control_failures
        text = (
            f"failed inside its own capture window in {ev.capture_failures} of "
            f"{ev.neighbor_runs} runs with neighbour threads; passed {passed} of {control} "
            "without them"
        )
        sites = self.store[nodeid].capture_sites
        if sites:
            text += f"; captured at {', '.join(sites[:3])}"
        text += f"; {self._protection_line(nodeid)}"
        found = self.attributions.get(nodeid)
        return f"{text}; {attr.describe(found)}" if found else text

    def test_fields(self, nodeid: str, replay: str) -> dict[str, Any]:
        """What summary.json's row of a capture-unsafe test adds: evidence, attribution,
        advice, the replay line with neighbours limited to the breaking kinds, and the
        protected reruns with their verdict (`survived`) and line (`protection`)."""
        ev = self._of(nodeid)
        protected = self._protected(nodeid)
        found = self.attributions.get(nodeid, attr.Attribution(undecided=list(self.calls)))
        breaking = found.breaks or list(self.calls)
        return {
            "capture_sites": list(self.store[nodeid].capture_sites),
            "neighbor_runs": ev.neighbor_runs,
            "capture_failures": ev.capture_failures,
            "control_runs": ev.control_runs + ev.batch_control_passes + ev.batch_control_failures,
            "control_failures": ev.control_failures + ev.batch_control_failures,
            **found.to_dict(),
            "verdict": attr.describe(found),
            "advice": attr.advice(found),
            "replay": f"{replay} {NEIGHBOR_CALLS_OPTION}={shlex.quote(','.join(breaking))}",
            "protect": list(protected.frameworks),
            "protected_runs": protected.runs,
            "protected_failures": protected.failures,
            "survived": protected.survived,
            "protection": self._protection_line(nodeid),
        }


def neighbor_args(with_neighbors: bool, calls: Sequence[str] = ()) -> tuple[str, ...]:
    """Extra plugin options for one process: neighbours off, or limited to `calls` kinds
    (later options win, so these override the sweep's own --capsafe-neighbors)."""
    if not with_neighbors:
        return ("--capsafe-neighbors=0",)
    return (f"{NEIGHBOR_CALLS_OPTION}={','.join(calls)}",) if calls else ()


def protect_choice(value: str) -> str:
    """A `--protect` value checked: `auto`, `none`, or integration names joined by commas
    (duplicates dropped); SweepError with a one-line reason otherwise."""
    value = value.strip()
    if value in (AUTO, NO_PROTECTION):
        return value
    names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise SweepError(
            f"--protect: unknown integration {(unknown or [value])[0]!r}; give auto, none or "
            f"a comma-separated list of: {', '.join(FRAMEWORKS)}"
        )
    return ",".join(names)


#: Run in the suite's directory by its interpreter: prints the integrations whose framework
#: it finds (importlib's spec only: nothing is imported, CUDA is not initialized).
_FIND_FRAMEWORKS = """
import importlib.util
for name, module in {table!r}.items():
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a missing parent package (`cuda` for cuda.core)
        found = False
    if found:
        print(name)
"""


def find_frameworks(cwd: Path, note: Callable[[str], None]) -> tuple[str, ...]:
    """The integrations whose framework the suite's interpreter finds (`--protect auto`),
    asked of it in its directory, as its test processes would import; a note and none
    when that check itself fails."""
    code = _FIND_FRAMEWORKS.format(table=FRAMEWORKS)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=dict(os.environ),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        note(f"--protect auto: could not look for the frameworks: {exc}")
        return ()
    if done.returncode:
        reason = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        note(f"--protect auto: could not look for the frameworks: {reason}")
        return ()
    found = set(done.stdout.split())
    return tuple(n for n in FRAMEWORKS if n in found)


def check_started(records_dir: Path) -> None:
    """NeighborsDidNotStart with the reason when a process's neighbours could not start."""
    for status in nb.read_statuses([records_dir]):
        if status.get("unavailable"):
            raise NeighborsDidNotStart(
                f"neighbour threads could not start in the test processes "
                f"({status['unavailable']}); no verdicts without them"
            )


def neighbor_summary(raw: Path) -> dict[str, Any]:
    """Every process's neighbour status summed: calls made and driver errors per call kind,
    processes that had them, and each thread problem (failed or did not stop)."""
    directories = [p for p in raw.iterdir() if p.is_dir()] if raw.is_dir() else []
    statuses = nb.read_statuses(directories)
    steps: dict[str, int] = {}
    errors: dict[str, int] = {}
    problems: list[str] = []
    for status in statuses:
        for kind, n in status.get("steps", {}).items():
            steps[kind] = steps.get(kind, 0) + int(n)
        for kind, n in status.get("driver_errors", {}).items():
            errors[kind] = errors.get(kind, 0) + int(n)
        problems += [str(p) for p in status.get("problems", [])]
    return {
        "processes": len(statuses),
        "backend": sorted({str(s.get("backend", "")) for s in statuses} - {""}),
        "calls": dict(sorted(steps.items())),
        "driver_errors": dict(sorted(errors.items())),
        "problems": problems,
        "unavailable": sorted({str(s["unavailable"]) for s in statuses if s.get("unavailable")}),
    }
