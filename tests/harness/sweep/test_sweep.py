"""`capsafe sweep` end to end on tiny suites written into tmp_path, run as subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.run import run_sweep
from capsafe_harness.sweep.runner import last_line, suite_root
from capsafe_harness.sweep.runs import run_seeds

FAST = ("--", "-p", "no:run-parallel", "-p", "no:hypothesispytest")  # lighter test processes
REPORT_FILES = ("records.jsonl", "tests.csv", "summary.json", "report.md", "report.html")


def make_suite(root: Path, **files: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    for name, body in files.items():
        (root / f"{name}.py").write_text(textwrap.dedent(body))
    return root


def sweep(*args: str, cwd: Path, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def summary_of(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def by_id(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["nodeid"]: t for t in summary["tests"]}


PASSING = """
    import pytest

    @pytest.mark.parametrize("i", range(5))
    def test_ok(i):
        assert i >= 0
"""


def test_all_passing_suite_exits_0_and_writes_every_report(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_ok=PASSING)
    out = tmp_path / "reports" / "s1"
    done = sweep(str(suite), "--runs", "2", "--workers", "0", "--seed", "3", "--out", str(out),
                 *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "all 5 tests pass" in done.stderr.splitlines()[-1]
    for name in REPORT_FILES:
        assert (out / name).is_file(), name
    summary = summary_of(out)
    assert summary["runs"] == 2 and summary["seeds"] == run_seeds(3, 2)
    assert summary["counts"]["pass"] == 5 and summary["searches"] == []
    assert set(summary) >= {"runs", "workers", "seeds", "backend", "duration_s", "tests",
                            "counts", "searches"}  # fmt: skip
    assert summary["backend"].startswith(("sim (", "cuda (")), summary["backend"]  # not "auto"
    assert set(summary["tests"][0]) == {
        "nodeid", "classification", "runs", "failures", "flake_rate", "flake_rate_ci",
        "isolation_runs", "isolation_failures", "polluters", "state_setters", "signals", "replay",
        "why", "unconfirmed", "message", "concurrent", "detection_chance", "capture",
        "collides_with", "cleaners", "fix",
    }  # fmt: skip
    assert summary["tests"][0]["nodeid"] == "test_ok.py::test_ok[0]"
    assert (tmp_path / "reports" / "history.csv").read_text().count("test_ok.py::test_ok") == 5
    assert (tmp_path / "reports" / "latest").resolve() == out.resolve()


XDIST_FIXTURES = """
    def test_worker_id(worker_id):
        assert worker_id

    def test_testrun_uid(testrun_uid):
        assert testrun_uid
"""


def test_tests_using_xdists_fixtures_pass_in_every_replay(tmp_path: Path) -> None:
    # The replays ran with `-p no:xdist`, so `worker_id` was "not found" in every one of
    # them: passing in every suite run, failing 3 of 3 alone, the test came out `flaky`.
    suite = make_suite(tmp_path / "suite", test_x=XDIST_FIXTURES)
    out = tmp_path / "out"
    done = sweep(str(suite), "--runs", "1", "--workers", "2", "--seed", "3", "--out", str(out),
                 *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tests = by_id(summary_of(out))
    assert {n: t["classification"] for n, t in tests.items()} == {
        "test_x.py::test_worker_id": "pass", "test_x.py::test_testrun_uid": "pass"
    }  # fmt: skip
    assert all(t["isolation_runs"] > 0 for t in tests.values())  # they did run alone


DEFECTS = """
    import os
    import pytest

    STATE = []

    @pytest.mark.parametrize("i", range(6))
    def test_polluter(i):
        STATE.append(i)

    def test_victim():
        assert not STATE, "polluted"

    def test_broken():
        assert 1 == 2

    def test_crash():
        os._exit(3)
"""


@pytest.mark.slow  # a polluter search among 6, a crash, reruns: the planted suites' kind
@pytest.mark.timeout(600)
def test_defects_are_classified_and_the_replay_reproduces(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_defects=DEFECTS)
    out = tmp_path / "out"
    done = sweep(str(suite), "--runs", "4", "--workers", "0", "--isolation-runs", "2",
                 "--seed", "11", "--out", str(out), *FAST, cwd=tmp_path, timeout=570)  # fmt: skip
    assert done.returncode == 1, done.stderr
    tests = by_id(summary_of(out))
    victim = tests["test_defects.py::test_victim"]
    assert victim["classification"] == "order-dependent"
    assert len(victim["polluters"]) == 1
    assert victim["polluters"][0].startswith("test_defects.py::test_polluter[")
    assert victim["isolation_failures"] == 0 and victim["failures"] >= 1
    assert tests["test_defects.py::test_broken"]["classification"] == "fail"
    crash = tests["test_defects.py::test_crash"]
    assert crash["classification"] == "fail" and "crash" in crash["signals"]
    # The recorded command replays polluter then victim and shows the failure again.
    again = subprocess.run(
        victim["replay"], shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )  # fmt: skip (relative to where it ran)
    assert again.returncode == 1, again.stdout
    assert "polluted" in again.stdout


def test_baseline_quarantine_turns_exit_1_into_0(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_b="def test_broken():\n    assert False\n")
    baseline = tmp_path / "quarantine.txt"
    baseline.write_text("# known bad, tracked elsewhere\ntest_b.py::test_broken\n")
    done = sweep(str(suite), "--runs", "1", "--workers", "0", "--isolation-runs", "1",
                 "--out", str(tmp_path / "out"), "--baseline", str(baseline), *FAST,
                 cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1 quarantined" in done.stderr


def test_pytest_args_after_double_dash_reach_pytest(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_k="def test_a():\n    pass\n\n"
                       "def test_b():\n    assert False\n")  # fmt: skip
    out = tmp_path / "out"
    done = sweep(str(suite), "--runs", "1", "--workers", "0", "--out", str(out), *FAST,
                 "-k", "test_a", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert list(by_id(summary_of(out))) == ["test_k.py::test_a"]


def test_budget_stops_new_work_and_still_reports(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_ok=PASSING)
    out = tmp_path / "out"
    done = sweep(str(suite), "--runs", "50", "--workers", "0", "--budget", "0.01",
                 "--out", str(out), *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = summary_of(out)
    assert summary["runs"] == 1
    assert any("budget" in note and "49 suite runs" in note for note in summary["notes"])


def test_suite_that_cannot_be_collected_is_a_usage_error(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_bad="def test_(:\n")
    done = sweep(str(suite), "--runs", "1", "--workers", "0", "--out", str(tmp_path / "o"),
                 *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2  # nothing could be collected
    assert "error            test_bad.py  E   SyntaxError" in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 3 and "Traceback" not in done.stderr


SLOW = """
    import os
    import time
    import pytest

    @pytest.mark.parametrize("i", range(40))
    def test_slow(i):
        with open(os.path.join(os.environ["CAPSAFE_SWEEP_SHARED"], f"pid-{os.getpid()}"), "w"):
            pass
        time.sleep(0.5)
"""


def _default_sigint() -> None:
    # Children inherit an ignored SIGINT (a shell's background job, or a parent sweep
    # launched that way), and Python then never raises KeyboardInterrupt: restore it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet is not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return "\nState:\tZ" not in status


def _rows(records: Path) -> int:
    return sum(p.read_text().count("\n") for p in records.glob("records-*.jsonl"))


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_writes_the_partial_report_and_exits_130(
    tmp_path: Path, stop: signal.Signals
) -> None:
    # SIGTERM (a cancelled CI job, `timeout`) once killed the sweep outright and left its
    # test process running, orphaned, with no report.
    suite = make_suite(tmp_path / "suite", test_slow=SLOW)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite),
         "--runs", "3", "--workers", "0", "--out", str(out), *FAST],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # a watchdog: the first test starts in seconds
        while _rows(out / "raw" / "run-1") < 4:  # a test or two recorded, however slowly
            assert time.monotonic() < deadline, "the first run never started"
            time.sleep(0.1)
        proc.send_signal(stop)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    summary = summary_of(out)
    how = "Ctrl-C" if stop == signal.SIGINT else "SIGTERM"
    assert any(f"interrupted ({how})" in note for note in summary["notes"]), summary["notes"]
    assert 0 < len(summary["tests"]) < 40
    assert any("had not run when the sweep stopped" in note for note in summary["notes"])
    assert (out / "report.html").is_file()
    # The headline said "All 8 tests pass" of a sweep that ran part of its work.
    said = re.fullmatch(rf"Interrupted \({how}\) in the runs phase after 0 of 3 suite runs; "
                        r"(\d+) of 40 collected tests ran", summary["interrupted"])  # fmt: skip
    assert said and 0 < int(said[1]) < 40, summary["interrupted"]
    assert f"{summary['interrupted']}: none failing so far." in (out / "report.md").read_text()
    assert "tests pass" not in (out / "report.md").read_text()
    assert 'class="verdict partial"' in (out / "report.html").read_text()
    pids = [int(p.name.split("-")[1]) for p in (out / "raw" / "shared").glob("pid-*")]
    assert pids and not [pid for pid in pids if _alive(pid)]  # the test process died with it


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_process_that_stops_making_progress_is_killed_and_recorded(tmp_path: Path) -> None:
    # SIGALRM blocked: pytest-timeout's signal method cannot interrupt it, the watchdog must.
    suite = make_suite(tmp_path / "suite", test_stuck="""
        import signal
        import time

        def test_ok():
            pass

        def test_stuck():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(600)
    """)  # fmt: skip
    # stall_s leaves room for a slow start-up (pytest under `-n 8` on two cores writes nothing
    # for seconds; 60 s is 20x an idle one): a kill before test_stuck started is the next
    # test's case, not this one.
    options = SweepOptions(paths=(suite,), out=tmp_path / "out", seed=1, runs=1, workers=0,
                           timeout=1, isolation_runs=1, stall_s=60, progress=False,
                           pytest_args=FAST[1:])  # fmt: skip
    summary = run_sweep(options).summary.to_dict()
    stuck = by_id(summary)["test_stuck.py::test_stuck"]
    assert stuck["classification"] == "fail" and "timeout" in stuck["signals"]
    assert any("killed in test_stuck.py::test_stuck" in note for note in summary["notes"])


@pytest.mark.slow
def test_a_process_killed_before_any_test_is_never_green(tmp_path: Path) -> None:
    # The run hangs after collection, before its first test: pytest itself would never finish.
    # The sweep used to report "all 0 tests pass" and exit 0.
    suite = make_suite(tmp_path / "suite", test_a=PASSING, conftest="""
        import signal
        import time

        def pytest_runtestloop(session):
            if not session.config.option.collectonly:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                time.sleep(60)
    """)  # fmt: skip
    options = SweepOptions(paths=(suite,), out=tmp_path / "out", seed=1, runs=1, workers=0,
                           timeout=1, isolation_runs=1, stall_s=1, progress=False,
                           pytest_args=FAST[1:])  # fmt: skip
    result = run_sweep(options)
    assert result.exit_code == 1 and "5 not passing (5 unverified)" in result.reason
    summary = result.summary.to_dict()
    assert {t["classification"] for t in summary["tests"]} == {"unverified"}
    assert all(t["why"].startswith("never ran") and t["detection_chance"] is None
               for t in summary["tests"])  # fmt: skip
    assert any("killed outside any test" in note for note in summary["notes"])


SESSION_HOOK = """
    import time

    def pytest_sessionfinish(session):
        if not session.config.option.collectonly:
            {action}
"""


def test_a_run_pytest_fails_with_every_test_passing_is_not_green(tmp_path: Path) -> None:
    # A raising session hook: pytest exits 1, and the sweep once said "all 5 tests pass", 0.
    suite = make_suite(
        tmp_path / "suite",
        test_a=PASSING,
        conftest=SESSION_HOOK.format(action='raise RuntimeError("boom")'),
    )
    out = tmp_path / "out"
    done = sweep(str(suite), "--runs", "2", "--workers", "0", "--out", str(out), *FAST,
                 cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.splitlines()[-1]
    assert "all 5 tests pass, but pytest failed 2 of 2 suite runs" in last
    assert "RuntimeError: boom" in last
    summary = summary_of(out)
    assert [e["run_id"] for e in summary["suite_errors"]] == ["run-1", "run-2"]
    assert "but pytest failed 2 of 2" in (out / "report.md").read_text()
    assert "but pytest failed 2 of 2" in (out / "report.html").read_text()


# The end of a real pytest-cov 7 run (addopts `--cov=mod --cov-fail-under=90`; pytest exit 1).
COV_FAIL_LOG = """\
TOTAL        4      1    75%
FAIL Required test coverage of 90% not reached. Total coverage: 75.00%
1 passed in 1.10s
"""


@pytest.mark.parametrize(
    ("log", "said"),
    [
        (COV_FAIL_LOG, "FAIL Required test coverage of 90% not reached. Total coverage: 75.00%"),
        ("RuntimeError: boom\n===== 2 passed, 1 warning in 0.31s =====\n", "RuntimeError: boom"),
        ("E   ImportError: x\nno tests ran in 0.01s\n", "E   ImportError: x"),
    ],
)
def test_a_suite_errors_message_is_what_pytest_said_before_its_counts(
    tmp_path: Path, log: str, said: str
) -> None:
    path = tmp_path / "run-1.log"
    path.write_text(log)
    assert last_line(path, past_counts=True) == said
    assert last_line(path) == log.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_that_hangs_after_its_last_test_is_not_green(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_a=PASSING,
                       conftest=SESSION_HOOK.format(action="time.sleep(600)"))  # fmt: skip
    # stall_s: 20x an idle start-up, so the kill lands after the last test, not before it.
    options = SweepOptions(paths=(suite,), out=tmp_path / "out", seed=1, runs=1, workers=0,
                           timeout=1, isolation_runs=1, stall_s=60, progress=False,
                           pytest_args=FAST[1:])  # fmt: skip
    result = run_sweep(options)
    assert result.exit_code == 1 and "all 5 tests pass, but pytest failed 1 of 1" in result.reason
    assert "no progress for 60s" in result.reason


def test_node_ids_that_change_between_processes_are_named_as_the_reason(tmp_path: Path) -> None:
    # An id made from the clock: collection lists one test, the run runs another.
    suite = make_suite(tmp_path / "suite", test_t="""
        import time

        import pytest

        @pytest.mark.parametrize("stamp", [time.time_ns()])
        def test_t(stamp):
            pass
    """)  # fmt: skip
    options = SweepOptions(paths=(suite,), out=tmp_path / "out", seed=1, runs=1, workers=0,
                           isolation_runs=1, progress=False, pytest_args=FAST[1:])  # fmt: skip
    summary = run_sweep(options).summary.to_dict()
    assert sorted(t["classification"] for t in summary["tests"]) == ["pass", "unverified"]
    assert any("node ids differ between processes" in note for note in summary["notes"])


def test_a_run_capsafe_did_not_record_is_a_usage_error(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_a=PASSING)
    done = sweep(str(suite), "--runs", "1", "--workers", "0", "--out", str(tmp_path / "o"),
                 *FAST, "-p", "no:capsafe", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "recorded no test: is it disabled (-p no:capsafe" in done.stderr.splitlines()[-1]


def test_suite_root_is_the_common_parent(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "t.py").write_text("")
    (tmp_path / "b").mkdir()
    assert suite_root([tmp_path / "a" / "t.py"]) == tmp_path / "a"
    assert suite_root([tmp_path / "a", tmp_path / "b"]) == tmp_path


def test_run_seeds_are_stable_and_distinct() -> None:
    assert run_seeds(1, 3) == run_seeds(1, 3)
    assert len(set(run_seeds(1, 20))) == 20
    assert run_seeds(1, 3) != run_seeds(2, 3) != run_seeds(1, 3, kind="alone")


def test_sweep_environment_gives_every_process_its_own_scratch_dir(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_env="""
        import os

        def test_scratch():
            scratch = os.environ["CAPSAFE_SWEEP_TMP"]
            assert os.path.isdir(scratch) and not os.listdir(scratch)
            open(os.path.join(scratch, "left-behind"), "w").close()
    """)  # fmt: skip
    done = sweep(str(suite), "--runs", "2", "--workers", "0", "--out", str(tmp_path / "o"),
                 *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_hostile_surroundings_become_notes_and_nothing_is_lost(tmp_path: Path) -> None:
    # A records line cut short, a history.csv that is not one, a `latest` that is a real
    # directory: the sweep still classifies, writes its report, and says what it did.
    suite = make_suite(tmp_path / "suite", test_junk="""
        import os

        def test_writes_a_torn_record_line(request):
            records = request.config.getoption("capsafe_records")
            with open(os.path.join(records, "records-torn-main-1.jsonl"), "w") as f:
                f.write('{"nodeid": "test_junk.py::test_writes_a_torn_re')
    """)  # fmt: skip
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "history.csv").write_bytes(b"\xff\xfe not a csv\x00")
    (reports / "latest").mkdir()
    (reports / "latest" / "keep.txt").write_text("mine")
    out = reports / "s1"
    done = sweep(str(suite), "--runs", "1", "--workers", "0", "--out", str(out), *FAST,
                 cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    notes = summary_of(out)["notes"]
    assert any("skipped 1 malformed record line" in n for n in notes), notes
    assert any("moved to history.csv.unreadable-" in n for n in notes), notes
    assert any("latest not updated" in n and "is a directory" in n for n in notes), notes
    (aside,) = reports.glob("history.csv.unreadable-*")
    assert aside.read_bytes() == b"\xff\xfe not a csv\x00"
    assert "test_junk.py::test_writes_a_torn_record_line" in (reports / "history.csv").read_text()
    assert (reports / "latest" / "keep.txt").read_text() == "mine"
    assert (out / "report.html").is_file()


TWO_SECONDS = """
    import time

    def test_two_seconds():
        time.sleep(2)
"""


@pytest.mark.parametrize("where", ["ini", "env"])
def test_the_projects_own_timeout_wins_over_the_sweeps(tmp_path: Path, where: str) -> None:
    # The sweep always passed --timeout=60: a project whose ini says `timeout = 1` was red
    # under plain pytest and green under the sweep.
    suite = make_suite(tmp_path / "suite", test_two=TWO_SECONDS)
    env = dict(os.environ)
    if where == "ini":
        (suite / "pytest.ini").write_text("[pytest]\ntimeout = 1\n")
    else:
        env["PYTEST_TIMEOUT"] = "1"
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite), "--runs",
         "1", "--workers", "0", "--isolation-runs", "1", "--out", str(out), *FAST],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    (test,) = summary_of(out)["tests"]
    assert test["classification"] != "pass" and "timeout" in test["signals"], test
    said = "timeout in pytest.ini" if where == "ini" else "the PYTEST_TIMEOUT environment variable"
    assert summary_of(out)["timeout"] == f"1 s (the project's own: {said})"
    assert f"Per-test timeout: 1 s (the project's own: {said})" in (out / "report.md").read_text()


def test_without_a_project_timeout_the_sweeps_is_used_and_named(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_ok=PASSING)
    out = tmp_path / "out"
    done = sweep(str(suite), "--runs", "1", "--workers", "0", "--timeout", "45",
                 "--out", str(out), *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert summary_of(out)["timeout"] == "45 s (--timeout; the project sets none)"
