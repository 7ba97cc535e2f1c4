"""Suite runs forked from the fork server (issue 21): a child per xdist worker, each given
the share the seeded scheduler deals it, once an xdist run showed the plan is xdist's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from forked_suites import CRASHES_WHEN_FORKED, when_forked, write_suite

from capsafe_harness.plugin import order
from capsafe_harness.records import Record, load_records
from capsafe_harness.sweep.executor import Launch
from capsafe_harness.sweep.fork_commands import split_run
from capsafe_harness.sweep.fork_runs import (
    ForkedRun,
    plan_differs,
    plan_shares,
    run_returncode,
    unplannable,
)
from capsafe_harness.sweep.fork_server import Job
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.run import Sweep
from capsafe_harness.sweep.state import prepare_out

QUIET = ("-p", "no:run-parallel", "-p", "no:hypothesispytest")

WHO_AM_I = """
import os, pathlib

def _note(worker_id, testrun_uid):
    shared = pathlib.Path(os.environ["CAPSAFE_SWEEP_SHARED"])
    line = " ".join([worker_id, os.environ.get("PYTEST_XDIST_WORKER", "-"),
                     os.environ.get("PYTEST_XDIST_WORKER_COUNT", "-"), testrun_uid,
                     os.environ.get("PYTEST_XDIST_TESTRUNUID", "-")])
    with open(shared / "seen.txt", "a") as f:
        f.write(line + "\\n")

def test_who(worker_id, testrun_uid):
    _note(worker_id, testrun_uid)

"""
MANY = "".join(f"def test_{k}():\n    pass\n\n" for k in range(12))


def sweep(
    suite: Path, out: Path, *, fork: bool = True, runs: int = 3, workers: int = 2
) -> dict[str, Any]:
    # stall_s: a hang watchdog, not a speed limit (a loaded machine starts xdist slowly)
    options = SweepOptions(paths=(suite,), out=out, invoked_from=suite, pytest_args=QUIET,
                           progress=False, fork=fork, runs=runs, workers=workers, seed=11,
                           timeout=30, stall_s=300)  # fmt: skip
    prepare_out(out, resume=False, force=False)
    Sweep(options).execute()
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def fork_notes(summary: dict[str, Any]) -> list[str]:
    return [n for n in summary["notes"] if n.startswith("fork server")]


def shares_of(rows: list[Record]) -> dict[str, list[str]]:
    """Each worker's tests in the order it ran them."""
    ran: dict[str, dict[str, int]] = {}
    for row in rows:
        ran.setdefault(row["worker"], {}).setdefault(row["nodeid"], row["index"])
    return {w: sorted(tests, key=tests.__getitem__) for w, tests in sorted(ran.items())}


@pytest.mark.timeout(600)
def test_forked_runs_are_the_xdist_runs_they_stand_for(tmp_path: Path) -> None:
    """Same seed, same shares, same order per worker as the runs under xdist; and every
    test sees the worker it ran as (xdist's fixtures and variables)."""
    suite = write_suite(tmp_path / "suite", {"test_who.py": WHO_AM_I, "test_many.py": MANY})
    forked = sweep(suite, tmp_path / "forked")
    # Every run after the first that showed the plan is forked: a first run a loaded machine
    # stalled or crashed shows nothing (its note says so) and leaves it to the next.
    notes = fork_notes(forked)
    undecided = sum(" could not show that xdist runs the plan" in n for n in notes)
    processes = json.loads((tmp_path / "forked" / "sweep.json").read_text())["processes"]
    assert undecided < 2 and any(n.startswith(f"fork server: {2 - undecided} suite run(s) "
                                              "forked") for n in notes), \
        (forked["notes"], {k: v for k, v in processes.items() if k.startswith("run-")})  # fmt: skip
    sweep(suite, tmp_path / "fresh", fork=False)
    for k in (1, 2, 3):  # run 1 is an xdist run in both: the one the plan is checked against
        got, want = (load_records(tmp_path / where / "raw" / f"run-{k}")[0]
                     for where in ("forked", "fresh"))  # fmt: skip
        assert shares_of(got) == shares_of(want) and set(shares_of(got)) == {"gw0", "gw1"}
    seen = (tmp_path / "forked" / "raw" / "shared" / "seen.txt").read_text().splitlines()
    in_runs = [line for line in seen if not line.startswith("master ")]  # not the alone screen
    assert len(in_runs) == 3  # once a run
    for line in in_runs:
        worker_id, variable, count, uid, uid_variable = line.split()
        assert worker_id in ("gw0", "gw1") and variable == worker_id and count == "2"
        assert uid == uid_variable != "-"
    assert {t["classification"] for t in forked["tests"]} == {"pass"}


EXITS_3_IN_RUN_1 = """
def pytest_sessionfinish(session):
    if session.config.getoption("capsafe_run_id") == "run-1":
        session.exitstatus = 3  # every test passed: the run cannot show its split is the plan
"""


@pytest.mark.timeout(600)
def test_a_run_that_cannot_show_the_plan_leaves_it_to_the_next_and_says_so(
    tmp_path: Path,
) -> None:
    """A first xdist run that stalled, crashed or exited oddly decides nothing: the next
    run is under xdist too, and the report says why (it said nothing before)."""
    suite = write_suite(tmp_path / "suite", {"conftest.py": EXITS_3_IN_RUN_1, "test_many.py": MANY})
    notes = fork_notes(sweep(suite, tmp_path / "out"))
    assert "fork server: run-1 (pytest exited 3) could not show that xdist runs the plan, " \
           "so the next suite run (if any) ran under xdist too" in notes, notes  # fmt: skip
    assert any(n.startswith("fork server: 1 suite run(s) forked") for n in notes), notes


REVERSES_LAST = """
import pytest

@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items):
    yield  # every plugin's change, capsafe's shuffle too
    items.reverse()
"""


@pytest.mark.timeout(600)
def test_a_plugin_reordering_after_the_shuffle_keeps_every_run_under_xdist(
    tmp_path: Path,
) -> None:
    suite = write_suite(tmp_path / "suite", {"conftest.py": REVERSES_LAST, "test_many.py": MANY})
    summary = sweep(suite, tmp_path / "out")
    notes = fork_notes(summary)
    assert "fork server: suite runs ran under xdist: a plugin reorders the tests after " \
           "capsafe's shuffle" in notes, notes  # fmt: skip
    assert not any("suite run(s) forked" in n for n in notes)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
@pytest.mark.timeout(600)
def test_a_forked_run_a_signal_ended_runs_again_under_xdist_and_only_that_counts(
    tmp_path: Path,
) -> None:
    suite = write_suite(tmp_path / "suite", {"test_c.py": CRASHES_WHEN_FORKED,
                                             "test_many.py": MANY})  # fmt: skip
    summary = sweep(suite, tmp_path / "out")
    assert {t["classification"] for t in summary["tests"]} == {"pass"}
    crashed = [n for n in fork_notes(summary) if "ran again fresh" in n]
    assert crashed and "run-2" in crashed[0] and "run-3" in crashed[0], fork_notes(summary)
    for k in (2, 3):  # only the xdist run's rows: none of the crashed child's
        rows = load_records(tmp_path / "out" / "raw" / f"run-{k}")[0]
        assert all(r["outcome"] == "passed" for r in rows)
        assert len({r["nodeid"] for r in rows}) == 13


def test_only_suite_runs_are_split_as_runs() -> None:
    base = [sys.executable, "-m", "pytest", "tests", "-p", "capsafe", "--rootdir=/s"]
    job = ["--capsafe-records=/r/run-2", "--capsafe-run-id=run-2", "--capsafe-seed=7"]
    run = split_run([*base, *job, "--capsafe-shuffle=module", "-n=2", "-q"])
    assert run is not None
    assert (run.workers, run.shuffle, run.replay.seed) == (2, "module", 7)
    assert run.replay.server_args == ("-p", "capsafe", "--rootdir=/s", "-n=0", "-q")
    assert split_run([*base, *job, "--capsafe-shuffle=module", "-n=0"]) is None  # one process
    assert split_run([*base, *job, "-n=2"]) is None  # no seeded order
    assert split_run([*base, *job[:2], "--capsafe-shuffle=global", "-n=2"]) is None  # no seed
    pinned = [*base, *job, "--capsafe-shuffle=global", "-n=2", "--capsafe-gpus=0,1"]
    assert split_run(pinned) is None  # each worker pinned to its device: run under xdist
    assert split_run([*base, *job, "--capsafe-shuffle=global", "-n=2", "-n=4"]) is None


def test_shares_are_the_shuffle_less_what_later_plugins_drop_dealt_round_robin() -> None:
    received = [f"t.py::test_{k}" for k in range(7)]
    items = [n for n in received if n != "t.py::test_3"]  # deselected after the shuffle
    shares = plan_shares(received, items, seed=5, shuffle="global", workers=2)
    ordered = [n for n in order.shuffled(received, 5, "global") if n in items]
    assert shares == [ordered[0::2], ordered[1::2]]


def server(**given: Any) -> Any:
    """What `unplannable` reads of a ready fork server."""
    items = ("t.py::a", "t.py::b")
    facts = {"received": items, "items": items, "dist": "no", "maxfail": 0,
             "worker_reads": (), **given}  # fmt: skip
    return SimpleNamespace(**facts)


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ({}, ""),
        ({"dist": "load"}, ""),  # what the server's own -n=0 never says, but an ini might
        ({"items": ("t.py::b", "t.py::a")}, "a plugin reorders the tests after capsafe's"),
        ({"items": ("t.py::a", "t.py::a")}, "the suite collects one node id twice"),
        ({"dist": "loadfile"}, "xdist schedules it with --dist loadfile"),
        ({"maxfail": 1}, "-x/--maxfail stops every xdist worker"),
        ({"worker_reads": ("conftest.py:3",)}, "the suite reads xdist's worker variables before"),
    ],
)
def test_a_collection_the_plan_cannot_follow_says_why(given: dict[str, Any], why: str) -> None:
    found = unplannable(server(**given))
    assert found.startswith(why) if why else found == ""


def row(nodeid: str, worker: str, index: int) -> Record:
    return {"nodeid": nodeid, "worker": worker, "index": index}  # type: ignore[typeddict-item]


def test_a_run_differs_from_its_plan_by_its_first_different_test() -> None:
    shares = [["a", "c"], ["b"]]
    same = [row("a", "gw0", 0), row("a", "gw0", 0), row("c", "gw0", 1), row("b", "gw1", 0)]
    assert plan_differs(shares, same) == ""
    swapped = [row("c", "gw0", 0), row("a", "gw0", 1), row("b", "gw1", 0)]
    assert plan_differs(shares, swapped) == "gw0's test 1 was c where the plan has a"
    short = [row("a", "gw0", 0), row("b", "gw1", 0)]
    assert plan_differs(shares, short) == "gw0's test 2 was none where the plan has c"
    one = [row("a", "gw0", 0), row("c", "gw0", 1), row("b", "gw0", 2)]
    assert plan_differs(shares, one) == "its workers were ['gw0'], the plan's ['gw0', 'gw1']"


@pytest.mark.parametrize(
    ("codes", "code"),
    [((0, 0), 0), ((0, 1), 1), ((5, 0), 0), ((5, 5), 5), ((1, -11), -11), ((3, 1), 3)],
)
def test_a_runs_exit_code_is_its_shares_as_xdist_gives_it(
    codes: tuple[int, ...], code: int
) -> None:
    assert run_returncode(codes) == code


def test_a_run_with_collection_errors_fails_as_xdist_fails_it() -> None:
    assert run_returncode((0, 0), collect_errors=True) == 1


class FakeJob:
    def __init__(self) -> None:
        self.killed = False
        self.returncode: int | None = None

    def kill(self) -> None:
        self.killed = True
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        return -9


class InterruptedServer:
    """Starts the first share, and Ctrl-C lands while the second is submitted."""

    errors = 0

    def __init__(self) -> None:
        self.started: list[FakeJob] = []

    def job_id(self) -> str:
        return str(len(self.started))

    def submit(self, job: Job) -> FakeJob:
        Path(job.records, f"records-{job.run_id}-{job.worker}-1.jsonl").write_text("{}\n")
        if self.started:
            raise KeyboardInterrupt
        self.started.append(FakeJob())
        return self.started[0]


def test_ctrl_c_while_a_runs_shares_start_kills_the_started_ones_and_keeps_nothing(
    tmp_path: Path,
) -> None:
    fake = InterruptedServer()
    records = tmp_path / "run-2"
    job = [f"--capsafe-records={records}", "--capsafe-run-id=run-2", "--capsafe-seed=3"]
    cmd = [sys.executable, "-m", "pytest", ".", "-p", "capsafe", *job, "--capsafe-shuffle=global",
           "-n=2"]  # fmt: skip
    run = split_run(cmd)
    assert run is not None
    launch = Launch("run-2", tuple(cmd), tmp_path, {}, records, tmp_path / "run-2.log", 60.0)
    proc = ForkedRun(fake, run, [["t.py::a"], ["t.py::b"]], launch, {},  # type: ignore[arg-type]
                     on_refused=lambda why: None)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        proc.start()
    assert fake.started[0].killed  # no share runs on unwatched
    assert not list(records.glob("records-*")) and not proc.forked
    proc.close()


MORE_WORKERS_THAN_TESTS = """
import os

def test_sees_every_worker_counted():  # a replay runs in one process, with no count
    assert os.environ.get("PYTEST_XDIST_WORKER_COUNT", "3") == "3"
"""


@pytest.mark.timeout(600)
def test_a_run_with_more_workers_than_tests_counts_every_worker(tmp_path: Path) -> None:
    suite = write_suite(tmp_path / "suite", {"test_one.py": MORE_WORKERS_THAN_TESTS})
    summary = sweep(suite, tmp_path / "out", workers=3)
    assert any(" suite run(s) forked" in n for n in fork_notes(summary)), fork_notes(summary)
    assert {t["classification"] for t in summary["tests"]} == {"pass"}


EXITS_WHEN_FORKED = when_forked("test_exits_only_forked", "os._exit(1)")


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
@pytest.mark.timeout(600)
def test_a_share_that_ends_before_its_last_test_runs_its_run_again_under_xdist(
    tmp_path: Path,
) -> None:
    """xdist replaces a worker that exits mid-test and runs the rest of its tests: a share's
    child that exits (with a code that reads as a run) leaves its later tests unrun."""
    suite = write_suite(tmp_path / "suite", {"test_x.py": EXITS_WHEN_FORKED,
                                             "test_many.py": MANY})  # fmt: skip
    summary = sweep(suite, tmp_path / "out")
    assert all(t["runs"] == 3 for t in summary["tests"]), [
        (t["nodeid"], t["runs"]) for t in summary["tests"] if t["runs"] != 3
    ]
    assert any("ran again fresh" in n for n in fork_notes(summary)), fork_notes(summary)


READS_WORKER_AT_IMPORT = """
import os

PORT = 8000 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
"""


@pytest.mark.timeout(600)
def test_a_suite_reading_its_worker_at_import_keeps_its_runs_under_xdist(tmp_path: Path) -> None:
    suite = write_suite(tmp_path / "suite", {"conftest.py": READS_WORKER_AT_IMPORT,
                                             "test_many.py": MANY})  # fmt: skip
    notes = fork_notes(sweep(suite, tmp_path / "out"))
    assert any("suite runs ran under xdist: the suite reads xdist's worker variables before "
               "its tests run (conftest.py:4)" in n for n in notes), notes  # fmt: skip
