"""Concurrency first (issue 24) and pair runs that narrow (issue 21): harness.sweep.parallel.

A failure that happened only beside another worker, and that a sequential replay of the
same order does not reproduce, is parallel-unsafe and never sent to a polluter search;
its partner is found by group testing over the tests that overlapped it.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from serial_host import SerialHost
from test_sweep import FAST, by_id, summary_of, sweep

from capsafe_harness.sweep.host import Replayed
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.parallel import FORKED, MAX_PAIR_RUNS, ParallelCheck
from capsafe_harness.sweep.store import EvidenceStore
from capsafe_harness.verdicts.evidence import VERIFY_TIMES
from capsafe_harness.verdicts.fold import Attempt

SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"
VICTIM = "t.py::test_victim"


def attempt(nodeid: str, run: str, worker: str, start: float, stop: float, *, failed: bool = False,
            index: int = 0) -> Attempt:  # fmt: skip
    return Attempt(nodeid, run, failed, frozenset(), worker, 1 if worker == "gw0" else 2, index,
                   start, 7, "boom" if failed else "", stop=stop)  # fmt: skip


class PairHost(SerialHost):
    """A host on which the victim fails beside `partner` (in a pair run, or in a run with
    it in another process) and passes in any single process: a collision."""

    def __init__(self, partner: str | None) -> None:
        self.partner = partner
        self.kinds: Counter[str] = Counter()
        self.groups: list[tuple[str, ...]] = []  # each pair run's candidates' side
        self._pair: list[Sequence[str]] = []
        self._victims = 0  # the test's sides of pair runs so far
        self._cond = threading.Condition()
        super().__init__()

    def replay(
        self, sequence: Sequence[str], *, seed: int | None, kind: str,
        extra: Sequence[str] = (), exclusive: bool = False, group: object = None,
    ) -> Replayed:  # fmt: skip
        with self._cond:
            self.kinds[kind] += 1
            beside: Sequence[str] = ()
            if kind == "beside" and VICTIM not in sequence:
                self.groups.append(tuple(dict.fromkeys(sequence)))
                self._pair.append(sequence)
                self._cond.notify_all()
            elif kind == "beside":  # the other side of its pair run is started first
                self._victims += 1
                self._cond.wait_for(lambda: len(self._pair) >= self._victims, timeout=60)
                beside = self._pair[self._victims - 1]
        failed = self.partner is not None and self.partner in beside
        found = {n: attempt(n, kind, "main", 0.0, 1.0, failed=failed and n == VICTIM)
                 for n in sequence}  # fmt: skip
        return Replayed(kind, found, 0, True, Path("log"))


def store_with_collision(tmp_path: Path, others: int) -> EvidenceStore:
    """Two runs in which the victim failed in gw0 while `others` tests ran in gw1, the
    first of them overlapping it most (both runs), the rest less."""
    store = EvidenceStore(tmp_path, 60.0)
    for run in ("run-1", "run-2"):
        store.run_ids.append(run)
        found = [attempt(VICTIM, run, "gw0", 10.0, 20.0, failed=True)]
        found += [attempt(f"t.py::test_{i}", run, "gw1", 10.0 + i, 11.0 + i, index=i)
                  for i in range(others)]  # fmt: skip
        for a in found:
            store.run_attempts[(run, a.nodeid)] = a
    ev = store.ev(VICTIM)
    ev.runs, ev.failures, ev.isolation_runs = 2, 2, 3
    return store


def check_on(
    tmp_path: Path, partner: str | None, others: int = 8
) -> tuple[ParallelCheck, PairHost]:
    host = PairHost(partner)
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    return ParallelCheck(options, host, store_with_collision(tmp_path, others)), host


def test_a_collision_is_parallel_unsafe_and_its_partner_is_narrowed_down(tmp_path: Path) -> None:
    check, host = check_on(tmp_path, partner="t.py::test_5")
    check.run()
    ev = check.store.ev(VICTIM)
    assert ev.concurrent and "t.py::test_5" in ev.concurrent
    assert ev.collides_with == ["t.py::test_5"]
    assert host.kinds["sequence"] == VERIFY_TIMES  # one replay of its order per round
    # the likeliest alone, then the seven others, halved down to one, then K - 1 more
    assert host.groups[0] == ("t.py::test_0",) and len(host.groups[1]) == 7
    assert host.groups[-VERIFY_TIMES:] == [("t.py::test_5",)] * VERIFY_TIMES
    assert host.kinds["beside"] == 2 * len(host.groups) <= 2 * (2 + 3 + VERIFY_TIMES)
    assert check.collided and check.store.notes[0].startswith("1 of 1 failing tests failed only")


def test_the_pair_search_stops_when_no_candidate_makes_it_fail(tmp_path: Path) -> None:
    check, host = check_on(tmp_path, partner=None)
    check.run()
    ev = check.store.ev(VICTIM)
    assert ev.concurrent and ev.collides_with == []
    assert len(host.groups) == 2  # the likeliest alone, then all the others: exhausted
    assert host.kinds["repeat"] == 1  # timed once, in one process: it repeats cleanly


class Forking(PairHost):
    """The victim fails beside its partner only where the pair run repeats it forked
    (`forked_only`), or fails repeated in one process (`repeatable` False: python-fs's
    test_addpath) and then collides only when repeated at all, so only forked."""

    def __init__(self, partner: str, *, repeatable: bool) -> None:
        super().__init__(partner)
        self.repeatable = repeatable
        self.sides: list[tuple[int, bool]] = []  # each test side: repetitions, forked?

    def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
        done = super().replay(sequence, **kw)
        forked = tuple(kw.get("extra", ())[-1:]) == FORKED
        repeated = sequence.count(VICTIM) > 1
        if kw["kind"] == "repeat" and repeated and not (forked or self.repeatable):
            done.attempts[VICTIM] = attempt(VICTIM, "repeat", "main", 0, 1, failed=True)
        if kw["kind"] == "beside" and VICTIM in sequence:
            self.sides.append((len(sequence), forked))
            collided = done.attempts[VICTIM].failed and forked and repeated
            done.attempts[VICTIM] = attempt(VICTIM, "beside", "main", 0, 1, failed=collided)
        return done


def test_a_test_that_cannot_repeat_in_one_process_repeats_forked_beside_its_partner(
    tmp_path: Path,
) -> None:
    """python-fs's test_addpath fails its second run in one process, so its side of a pair
    run ran it once, and its collision, a few milliseconds wide, seldom came 3 times of 3:
    its repetitions are timed again in forked children, and its pair runs fork them too."""
    host = Forking("t.py::test_0", repeatable=False)
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store_with_collision(tmp_path, 4))
    check.run()
    assert check.store.ev(VICTIM).collides_with == ["t.py::test_0"]
    assert host.kinds["repeat"] == 2  # in one process (it failed), then forked
    assert len(host.sides) == VERIFY_TIMES and all(n > 1 and forked for n, forked in host.sides)


def test_a_test_whose_in_process_pair_runs_find_nothing_is_not_retried_forked(
    tmp_path: Path,
) -> None:
    """A forked retry of the pair search named a false partner: the planted
    test_needs_no_xdist, which fails in any xdist worker and has none, failed 3 of 3 in
    forked pair runs beside the test next to it. A test that repeats cleanly in one
    process keeps its in-process pair runs only."""
    host = Forking("t.py::test_0", repeatable=True)
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store_with_collision(tmp_path, 4))
    check.run()
    assert check.store.ev(VICTIM).collides_with == []
    assert host.sides and not any(forked for _, forked in host.sides)


def test_no_forked_repetitions_beside_neighbour_threads(tmp_path: Path) -> None:
    # A forked child has none of its parent's threads (a GPU suite's neighbours).
    host = Forking("t.py::test_0", repeatable=False)
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2, neighbors=1)
    check = ParallelCheck(options, host, store_with_collision(tmp_path, 4))
    check.run()
    assert host.kinds["repeat"] == 1 and not any(forked for _, forked in host.sides)
    assert check.store.ev(VICTIM).collides_with == []


def test_the_pair_runs_of_one_test_are_bounded(tmp_path: Path) -> None:
    class Unsure(PairHost):  # fails beside any group holding test_0..3, never confirms one
        def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
            done = super().replay(sequence, **kw)
            if kw["kind"] == "beside" and VICTIM in sequence:
                hit = len(self.groups) % 2 == 1
                done.attempts[VICTIM] = attempt(VICTIM, "beside", "main", 0, 1, failed=hit)
            return done

    host = Unsure(None)
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store_with_collision(tmp_path, 16))
    check.run()
    assert len(host.groups) <= MAX_PAIR_RUNS


def test_a_pair_run_whose_test_side_ended_first_is_run_again_longer(tmp_path: Path) -> None:
    """On a loaded machine one side of a pair run can crawl: the test's side was over
    while the partner's still ran, so its pass said nothing, and it is run again with the
    test's side as long as the partner's really was (python-fs under load)."""

    class Crawling(PairHost):  # the first pair run's test side ends a third of the way in
        def __init__(self, partner: str) -> None:
            super().__init__(partner)
            self.mine: list[int] = []  # repetitions of the test's side, each pair run

        def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
            done = super().replay(sequence, **kw)
            if kw["kind"] == "beside" and VICTIM in sequence:
                self.mine.append(len(sequence))
                if len(self.mine) == 1:
                    done.attempts[VICTIM] = attempt(VICTIM, "beside", "main", 0.0, 0.3)
            return done

    store = EvidenceStore(tmp_path, 60.0)
    for run in ("run-1", "run-2"):  # a short test, so its repetitions are timed
        store.run_ids.append(run)
        for a in (attempt(VICTIM, run, "gw0", 10.0, 10.05, failed=True),
                  attempt("t.py::test_0", run, "gw1", 10.0, 10.1)):  # fmt: skip
            store.run_attempts[(run, a.nodeid)] = a
    ev = store.ev(VICTIM)
    ev.runs, ev.failures, ev.isolation_runs = 2, 2, 3
    host = Crawling("t.py::test_0")
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store)
    check.run()
    assert store.ev(VICTIM).collides_with == ["t.py::test_0"]
    assert len(host.mine) == 1 + VERIFY_TIMES  # the cut-short pair run, then K that failed
    assert host.mine[1] > host.mine[0]  # run again with the test's side longer


def test_a_test_the_runs_timed_long_is_still_timed_and_repeated(tmp_path: Path) -> None:
    """The victim took 10 s in the suite runs (waiting on its partner, or a loaded
    machine): its repetitions are timed alone all the same, and its side of a pair run
    repeats it, where untimed it ran once (shared_dir under load named no partner)."""

    class Sides(PairHost):
        def __init__(self, partner: str) -> None:
            super().__init__(partner)
            self.mine: list[int] = []  # repetitions of the test's side, each pair run

        def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
            if kw["kind"] == "beside" and VICTIM in sequence:
                self.mine.append(len(sequence))
            return super().replay(sequence, **kw)

    host = Sides("t.py::test_0")
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store_with_collision(tmp_path, 2))
    check.run()
    assert host.kinds["repeat"] == 1
    assert host.mine and min(host.mine) > 1
    assert check.store.ev(VICTIM).collides_with == ["t.py::test_0"]


class Ordered(PairHost):
    """The victim fails after what ran before it in its process (its order's replay)."""

    def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
        done = super().replay(sequence, **kw)
        if kw["kind"] == "sequence":
            done.attempts[VICTIM] = attempt(VICTIM, "sequence", "main", 0, 1, failed=True)
        return done


def test_a_failure_its_order_reproduces_goes_to_the_order_search(tmp_path: Path) -> None:
    host = Ordered("t.py::test_0")
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store_with_collision(tmp_path, 4))
    check.run()
    assert check.store.ev(VICTIM).concurrent == [] and host.kinds["beside"] == 0
    assert host.kinds["sequence"] == 1  # failing its order once decides it
    assert not check.store.explained(VICTIM)  # the polluter search takes it


def test_an_order_that_decided_its_suspect_is_not_replayed_again_beside_it(
    tmp_path: Path,
) -> None:
    # Two pool threads, as a sweep has: the victim failed in two processes, so two replays
    # of its orders are queued at once. The first one fails and decides it; the second
    # used to have chosen before that came and replay its order all the same.
    class Threaded(Ordered):
        def pool(self, desc: str, jobs: Sequence[Any], work: Any, target: Any = None) -> None:
            with concurrent.futures.ThreadPoolExecutor(2) as threads:
                list(threads.map(lambda job: work(job, 0), jobs))

        def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
            if kw["kind"] == "sequence":
                time.sleep(0.2)  # the other thread chooses meanwhile
            return super().replay(sequence, **kw)

    host = Threaded("t.py::test_0")
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store_with_collision(tmp_path, 4))
    check.run()
    assert host.kinds["sequence"] == 1
    assert not check.store.explained(VICTIM)  # the polluter search takes it


def test_every_order_a_suspect_failed_in_is_replayed(tmp_path: Path) -> None:
    """A test that failed in five runs, four of them collisions and the last after its
    polluter (python-fs's test_mkdir): the fifth order is replayed too, and fails."""
    polluter = "t.py::test_polluter"

    class Ordered(PairHost):  # fails after the polluter in its process, passes otherwise
        def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
            done = super().replay(sequence, **kw)
            if kw["kind"] == "sequence" and polluter in sequence:
                done.attempts[VICTIM] = attempt(VICTIM, "sequence", "main", 0, 1, failed=True)
            return done

    store = EvidenceStore(tmp_path, 60.0)
    for i in range(1, 6):
        run = f"run-{i}"
        store.run_ids.append(run)
        found = [attempt(VICTIM, run, "gw0", 10.0, 20.0, failed=True, index=1),
                 attempt("t.py::test_0", run, "gw1", 10.0, 11.0)]  # fmt: skip
        if i == 5:
            found.append(attempt(polluter, run, "gw0", 9.0, 9.5, index=0))
        for a in found:
            store.run_attempts[(run, a.nodeid)] = a
    ev = store.ev(VICTIM)
    ev.runs, ev.failures, ev.isolation_runs = 5, 5, 3
    host = Ordered("t.py::test_0")
    options = SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2)
    check = ParallelCheck(options, host, store)
    check.run()
    assert store.ev(VICTIM).concurrent == [] and host.kinds["beside"] == 0
    assert not check.store.explained(VICTIM)  # the polluter search takes it
    assert host.kinds["sequence"] <= 5  # each failing order at most once: it failed in one


def test_a_failure_with_no_other_worker_running_is_no_suspect(tmp_path: Path) -> None:
    store = store_with_collision(tmp_path, 0)
    check = ParallelCheck(SweepOptions(paths=(tmp_path,), out=tmp_path, seed=1, workers=2),
                          PairHost(None), store)  # fmt: skip
    assert check.suspects() == []


def sweep_by_key(
    suite: Path, tmp_path: Path
) -> tuple[dict[str, Any], Path, subprocess.CompletedProcess[str], dict[str, Any]]:
    """(its answer key, --out, the finished sweep, its summary) of a planted suite swept
    with its key's options; the sweep exits 1, as a sweep that found something does."""
    key = json.loads((suite / "answer_key.json").read_text())
    options = [f"--{k.replace('_', '-')}={v}" for k, v in key["sweep"].items()]
    out = tmp_path / "o"
    done = sweep(str(suite), *options, "--timeout", "10", "--out", str(out), *FAST,
                 cwd=tmp_path, timeout=570)  # fmt: skip
    assert done.returncode == 1, done.stderr
    return key, out, done, summary_of(out)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang watchdog
def test_the_planted_collisions_are_parallel_unsafe_with_no_order_search(tmp_path: Path) -> None:
    key, out, done, summary = sweep_by_key(SUITES / "collisions", tmp_path)
    tests = by_id(summary)
    colliding = {n for n, t in key["tests"].items() if t["classification"] == "parallel-unsafe"}
    for nodeid, want in key["tests"].items():
        test = tests[nodeid]
        assert test["classification"] == want["classification"], (test, done.stderr)
        assert test["polluters"] == want["polluters"]
        assert test["collides_with"] == want.get("collides_with", [])
    # The processes of each phase, by what they ran last: the colliding tests were the
    # target of sequence replays and pair runs, and of no search replay or verification.
    processes = json.loads((out / "sweep.json").read_text())["processes"]
    targets: Counter[str] = Counter()
    for label in processes:
        replay = out / "raw" / "replays" / f"{label}.txt"
        if replay.is_file() and replay.read_text().split()[-1] in colliding:
            targets[label.rsplit("-", 1)[0]] += 1
    assert targets["replay"] == targets["verify"] == 0, targets
    assert targets["sequence"] >= 1 and targets["beside"] >= 1, targets
    assert not [s for s in summary["searches"] if s["victim"] in colliding]
    assert "parallel" in summary["phase_times"]["sweep_s"]
    assert summary["notes"][0].startswith("2 of 3 failing tests failed only in collisions")


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang watchdog
def test_a_partner_that_collides_in_its_module_teardown_is_named(tmp_path: Path) -> None:
    """repro/suites/shared_dir, shaped like python-fs: one module's setup_function makes
    a shared directory and writes into it, another's teardown_module removes it. The
    partner's own test does nothing to the directory, so a pair run names it only if each
    repetition tears its module down (harness/plugin/repeats.py; before, the test's side
    passed every pair run and no partner was named)."""
    _, _, done, summary = sweep_by_key(SUITES / "shared_dir", tmp_path)
    victim = by_id(summary)["test_index.py::test_index_name"]
    assert victim["classification"] == "parallel-unsafe", (victim, done.stderr)
    assert victim["collides_with"] == ["test_cleanup.py::test_cleanup_name"], victim["why"]
    assert not summary["searches"]
    assert [t["nodeid"] for t in summary["tests"] if t["classification"] != "pass"] == [
        "test_index.py::test_index_name"
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang watchdog
def test_a_partner_of_a_test_that_cannot_run_twice_in_a_process_is_named(tmp_path: Path) -> None:
    """repro/suites/import_once, shaped like python-fs's test_addpath: the victim imports a
    module it first expects not to be importable, so it fails its second run in one
    process. Its pair runs repeat it in forked children (harness/plugin/forked.py); run
    once a pair run, as before, it collided about half the time and seldom 3 of 3."""
    key, out, done, summary = sweep_by_key(SUITES / "import_once", tmp_path)
    nodeid = "test_loader.py::test_load_plugin"
    victim = by_id(summary)[nodeid]
    assert victim["classification"] == "parallel-unsafe", (victim, done.stderr)
    assert victim["collides_with"] == key["tests"][nodeid]["collides_with"], victim["why"]
    assert not summary["searches"]
    replays = {p.stem: p.read_text().split() for p in (out / "raw" / "replays").glob("*.txt")}
    assert len([label for label in replays if label.startswith("repeat-")]) == 2
    sides = [ids for label, ids in replays.items() if label.startswith("beside-") and nodeid in ids]
    assert sides and all(len(ids) > 1 for ids in sides)  # repeated, so forked
