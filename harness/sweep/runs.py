"""Phases 0 and 1, collection and the suite runs.

0. collection: the node ids exactly as `pytest --collect-only -q` prints them, and every
   collection error (class `error`);
1. runs: the whole suite N times under xdist, a different seed each, alternating a
   global shuffle with a bucketed one (module -> class -> test). A shard does its share
   of the runs; --resume takes the runs the sweep before finished from their records,
   as `capsafe merge` takes every shard's (`load_run`, `reload`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..plugin import randomly
from ..plugin.collection import Collected
from ..records import load_records
from ..verdicts import fold
from . import capture_sweep
from .bytecode import PYCACHE
from .host import SweepHost
from .journal import JOURNAL_FILE
from .options import SweepError, SweepOptions
from .runner import PYTEST_NO_RUN, Interrupted, ProcessResult, last_line, usage_error_line
from .state import STATE_FILE, read_state
from .store import EvidenceStore

SHUFFLES = ("global", "module")  # run k uses SHUFFLES[(k - 1) % 2]


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


def shuffle_of(k: int) -> str:
    """The shuffle of suite run k (1-based): global and bucketed in turn."""
    return SHUFFLES[(k - 1) % len(SHUFFLES)]


class SuiteRuns:
    """Collection and the suite runs of one sweep, into its store."""

    def __init__(
        self, options: SweepOptions, host: SweepHost, store: EvidenceStore,
        capture: capture_sweep.CapturePhases, bar: Any,
    ) -> None:  # fmt: skip
        """`host`: the sweep's own, for its runner and budget (suite runs are no replays)."""
        self.options = options
        self.host = host
        self.runner = host.runner
        self.store = store
        self.capture = capture
        self.bar = bar
        self.raw = store.raw
        self.walls: list[float] = []  # wall seconds of each suite run this sweep ran

    @property
    def mean_wall(self) -> float | None:
        """Seconds a suite run took here, on average; None when none ran here (resumed)."""
        return sum(self.walls) / len(self.walls) if self.walls else None

    def numbers(self) -> list[int]:
        """The suite runs (1-based) this sweep does: all of them, or a shard's share."""
        o = self.options
        return o.shard.runs(o.runs) if o.shard else list(range(1, o.runs + 1))

    # -- phase 0: collection --------------------------------------------------
    def collect(self) -> None:
        self.take_collection(self.runner.collect())

    def take_collection(self, found: Collected) -> None:
        """The suite's node ids and collection errors (pytest's, or a shard's, loaded)."""
        self.store.collected = found.nodeids
        if found.randomly and randomly.NOTE not in self.store.notes:
            self.store.note(randomly.NOTE)
        for nodeid, message in found.errors.items():
            ev = self.store.ev(nodeid)
            ev.collect_error = ev.message = message
        if not found.nodeids and not found.errors:
            raise SweepError("pytest could not run the suite (exit 5): no tests were collected")
        self.bar.add(len(self.numbers()) * len(found.nodeids))

    # -- phase 1: runs --------------------------------------------------------
    def run(self) -> None:
        o = self.options
        store = self.store
        if o.resume:
            self._resume()  # before the server below writes into raw/: it clears raw/
        self.write_state()
        self.runner.prestart_replays()  # its start-up and collection beside the runs
        seeds = run_seeds(o.seed, o.runs)
        todo = [k for k in self.numbers() if k not in store.runs_done]
        for i, k in enumerate(todo):
            run_id, seed, shuffle = f"run-{k}", seeds[k - 1], shuffle_of(k)
            if store.run_ids and not self.host.budget_left():
                self.host.skip_for_budget("suite runs", len(todo) - i)
                break
            cmd = self.runner.pytest_command(
                self.runner.targets(), self.raw / run_id, run_id, seed=seed,
                workers=o.workers, shuffle=shuffle,
            )  # fmt: skip
            started = time.monotonic()
            try:
                result = self.runner.run(run_id, cmd)
            except Interrupted as stop:
                self._add_run(run_id, seed, shuffle, stop.result, finished=False)
                raise
            self.walls.append(time.monotonic() - started)
            self._check_ran(result)
            capture_sweep.check_started(self.raw / run_id)
            self._add_run(run_id, seed, shuffle, result)
            store.runs_done.add(k)
            self.write_state()

    def _resume(self) -> None:
        """The runs the sweep in --out finished: their records become evidence again."""
        state = read_state(self.options.out)
        done = sorted(int(k) for k in state["runs_done"])
        for k in done:
            self.load_run(k, state.get("processes", {}))
        kept = {f"run-{k}" for k in done} | {f"run-{k}.log" for k in done} | {"shared", PYCACHE}
        replays = self.host.journal.labels()  # finished replays: served, not redone
        kept |= replays | {f"{label}.log" for label in replays} | {JOURNAL_FILE, "replays"}
        for entry in self.raw.iterdir():  # what the interrupt cut off: redone
            if entry.name not in kept and entry.name != "collected.json":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        self.store.note(f"resumed: {len(done)} of {self.options.runs} runs and "
                        f"{len(replays)} finished replays from the sweep before")  # fmt: skip

    def load_run(self, k: int, facts: Mapping[str, Any]) -> None:
        """Suite run k from its records in raw/ (a resumed sweep's, or a shard's copied in)."""
        run_id = f"run-{k}"
        seed = run_seeds(self.options.seed, k)[k - 1]
        self._add_run(run_id, seed, shuffle_of(k), self.reload(run_id, facts))
        self.store.runs_done.add(k)
        self.bar.update(len(self.store.collected))

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

    def write_state(self) -> None:
        """sweep.json: the options and runs done, and what --resume and `capsafe merge` need
        besides the records: where pytest ran, each process's exit, which alone rerun counts."""
        store = self.store
        with store.lock:
            state = {
                "options": self.options.identity(),
                "runs_done": sorted(store.runs_done),
                "invoked_from": str(self.options.invoked_from or Path.cwd()),
                "processes": dict(store.processes),
                "alone": [
                    [n, rerun, label] for (n, rerun), label in sorted(store.alone_done.items())
                ],
            }
        (self.options.out / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")

    def _add_run(
        self, run_id: str, seed: int, shuffle: str, result: ProcessResult, *, finished: bool = True
    ) -> None:
        store = self.store
        store.run_ids.append(run_id)
        store.seeds.append(seed)
        store.shuffles.append(shuffle)
        store.take(result)
        found = result.attempts()
        if finished:
            self._check_suite_exit(result, found.values())
        store.run_attempts.update(found)
        for attempt in found.values():
            self.capture.saw(attempt, neighbors=bool(self.options.neighbors))
            ev = store.ev(attempt.nodeid)
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
        if any(ev.collect_error for ev in self.store.evidence.values()):
            return  # pytest's exit 1 is the collection errors', already each an `error`
        message = (self.store.stall_text(result) if result.stalled
                   else last_line(result.log, past_counts=True) or f"see {result.log}")  # fmt: skip
        self.store.suite_errors.append({"run_id": result.label, "returncode": result.returncode,
                                        "message": message, "log": str(result.log)})  # fmt: skip
        self.store.note(f"{result.label}: pytest exited {result.returncode} with no test "
                        f"failing: {message} (see {result.log})")  # fmt: skip

    def _check_ran(self, result: ProcessResult) -> None:
        if result.rows or result.stalled:
            return
        detail = usage_error_line(result.log) or f"see {result.log}"
        if result.returncode == 0:  # pytest ran tests, and capsafe's plugin saw none of them
            raise SweepError(f"pytest ran the suite (exit 0: {detail}) but capsafe's plugin "
                             "recorded no test: is it disabled (-p no:capsafe in the arguments "
                             "or in addopts)?")  # fmt: skip
        if result.returncode not in PYTEST_NO_RUN:
            return
        raise SweepError(f"pytest could not run the suite (exit {result.returncode}): {detail}")
