"""Regression tests for issue 10, problems 1-9: verdicts a person can trust on real suites.

Each builds a tiny suite that misled the sweep before, runs `capsafe sweep` on it as a
user would, and checks the verdict and the evidence behind it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_sweep import FAST, by_id, make_suite, summary_of, sweep


def write(root: Path, files: dict[str, str]) -> Path:
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(body))
    return root


# -- problem 1: a broken suite is never green -----------------------------------------


def test_a_collection_error_is_a_verdict_with_pytests_message(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_good="def test_ok():\n    pass\n",
                       test_bad="def test_bad(:\n")  # fmt: skip
    out = tmp_path / "o"
    done = sweep(".", "--runs", "2", "--workers", "2", "--out", str(out), *FAST, cwd=suite)
    assert done.returncode == 1, done.stderr
    tests = by_id(summary_of(out))
    assert tests["test_bad.py"]["classification"] == "error"
    assert "SyntaxError" in tests["test_bad.py"]["message"]
    assert tests["test_good.py::test_ok"]["classification"] == "pass"
    assert "error            test_bad.py" in done.stderr and "SyntaxError" in done.stderr
    assert (
        "1 error" in (out / "report.md").read_text() or "error" in (out / "report.md").read_text()
    )


# -- problem 2: one --out, one sweep --------------------------------------------------


def test_reusing_out_is_refused_and_force_starts_over(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_x="def test_x():\n    assert False\n")
    out = tmp_path / "o"
    first = sweep(str(suite), "--runs", "1", "--workers", "0", "--out", str(out), *FAST,
                  cwd=tmp_path)  # fmt: skip
    assert first.returncode == 1
    (suite / "test_x.py").write_text("def test_x():\n    assert True\n")
    again = sweep(str(suite), "--runs", "1", "--workers", "0", "--out", str(out), *FAST,
                  cwd=tmp_path)  # fmt: skip
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"capsafe sweep: --out {out} holds a sweep already: --resume to continue it, "
        "--force to start over, or another --out"
    )
    forced = sweep(str(suite), "--runs", "1", "--workers", "0", "--out", str(out), "--force",
                   *FAST, cwd=tmp_path)  # fmt: skip
    assert forced.returncode == 0, forced.stderr
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["outcome"] for r in rows} == {"passed"}


def test_resume_continues_the_runs_it_had_not_done(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_x="def test_x():\n    pass\n")
    out = tmp_path / "o"
    args = ("--runs", "3", "--workers", "0", "--seed", "5", "--out", str(out), *FAST)
    assert sweep(str(suite), *args, cwd=tmp_path).returncode == 0
    state = json.loads((out / "sweep.json").read_text())
    state["runs_done"] = [1]  # as if the sweep had been stopped after its first run
    (out / "sweep.json").write_text(json.dumps(state))
    kept = (out / "raw" / "run-1").stat().st_mtime_ns
    done = sweep(str(suite), "--resume", *args[:-len(FAST) - 2], "--out", str(out), *FAST,
                 cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = summary_of(out)
    assert summary["runs"] == 3 and any("resumed: 1 of 3 runs" in n for n in summary["notes"])
    assert (out / "raw" / "run-1").stat().st_mtime_ns == kept
    other = sweep(str(suite), "--resume", "--runs", "4", "--workers", "0", "--out", str(out),
                  *FAST, cwd=tmp_path)  # fmt: skip
    assert other.returncode == 2 and "--resume: runs is 4 here but 3" in other.stderr


# -- problems 3 and 4: pytest's own node ids, from where the user stands ----------------

PROJECT = {
    "data/expected.txt": "42\n",
    "tests/test_files.py": """
        def test_reads_a_repository_file():
            assert open("data/expected.txt").read().strip() == "42"

        def test_plain():
            pass
    """,
}


def collect_only(project: Path, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args], cwd=project, capture_output=True,
                          text=True)  # fmt: skip
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize(
    "out", ["inside/reports/s", pytest.param("../elsewhere/deep/s", marks=pytest.mark.slow)]
)
def test_node_ids_are_pytests_and_pytest_runs_where_the_user_stands(
    tmp_path: Path, out: str
) -> None:
    project = write(tmp_path / "proj" / "name", PROJECT)  # no ini file: rootdir from the args
    done = sweep("tests", "--runs", "1", "--workers", "2", "--out", out, *FAST, cwd=project)
    assert done.returncode == 0, done.stderr
    ids = sorted(by_id(summary_of(project / out)))
    assert ids == sorted(collect_only(project, "tests"))
    assert ids[0].startswith("tests/test_files.py::")
    quarantine = project / "quarantine.txt"
    quarantine.write_text("\n".join(collect_only(project, "tests")) + "\n")
    (project / "tests" / "test_files.py").write_text("def test_plain():\n    assert False\n")
    again = sweep("tests", "--runs", "1", "--workers", "0", "--out", out + "-2",
                  "--baseline", str(quarantine), *FAST, cwd=project)  # fmt: skip
    assert again.returncode == 0, again.stderr  # the quarantine written from pytest's ids holds


# -- problem 5: nondeterminism never buys a cause --------------------------------------

COUNTER = """
    import os

    def invocation(name):
        path = os.path.join(os.environ["CAPSAFE_SWEEP_SHARED"], name)
        n = int(open(path).read()) + 1 if os.path.exists(path) else 1
        open(path, "w").write(str(n))
        return n
"""


@pytest.mark.slow  # 4 runs, reruns and a search
def test_a_test_that_crashes_half_the_time_gets_no_polluter(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", counter=COUNTER, test_crash="""
        import os
        from counter import invocation

        def test_sometimes_crashes(request):
            # Crashes its process every other time it runs beside other tests: one replay
            # reproduces "a polluter", the next does not.
            if invocation("crash") % 2 == 0 and len(request.session.items) > 1:
                os._exit(1)
    """, **{f"test_pad{i}": f"def test_pad{i}():\n    pass\n" for i in range(6)})  # fmt: skip
    out = tmp_path / "o"
    done = sweep(str(suite), "--runs", "4", "--workers", "0", "--seed", "2", "--out", str(out),
                 *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr
    test = by_id(summary_of(out))["test_crash.py::test_sometimes_crashes"]
    assert test["classification"] == "flaky" and test["polluters"] == []
    assert f"failed {test['failures']} of {test['runs']} suite runs" in test["why"]


@pytest.mark.slow  # 4 runs, then reruns alone
def test_failing_every_rerun_alone_but_passing_in_the_suite_is_not_fail(tmp_path: Path) -> None:
    # Fails alone every time (replayed alone) and in every other suite run: no state-setter
    # can explain that, so it is flaky, and the words say what the numbers say.
    suite = make_suite(tmp_path / "suite", counter=COUNTER, test_coin="""
        import sys
        from counter import invocation

        def test_coin():
            n = invocation("coin")
            alone = any(arg.startswith("--capsafe-replay") for arg in sys.argv)
            assert not alone and n % 2 == 1
    """)  # fmt: skip
    out = tmp_path / "o"
    done = sweep(str(suite), "--runs", "4", "--workers", "1", "--seed", "2", "--out", str(out),
                 *FAST, cwd=tmp_path)  # fmt: skip
    test = by_id(summary_of(out))["test_coin.py::test_coin"]
    assert (test["failures"], test["runs"], test["isolation_failures"]) == (2, 4, 3), test
    assert test["classification"] == "flaky", done.stderr
    assert test["why"] == "failed 2 of 4 suite runs; failed 3 of 3 alone"


# -- problems 5 and 9: tests colliding in one working directory ------------------------

# The planted collisions must not hinge on when each process started (on a loaded machine
# process starts differ by seconds), yet a process run alone must never wait. So a test
# meets only the processes it knows run beside it: the other xdist workers of its run
# (xdist starts no test before every worker has collected, and the conftest registers a
# worker before it reports its collection), or, in the pair run the sweep starts to try a
# partner (run id `beside-N`), the one other process of the pair, which may not have
# started yet but is sure to come. `meet(step)` returns once each of them has reached the
# same step or ended its session: no wall-clock limit; a partner that never comes is a
# hang, for the sweep's per-test timeout and the stall watchdog. The helper and its
# conftest are the planted collisions suite's own (repro/suites/collisions): one copy.
COLLISIONS_SUITE = Path(__file__).resolve().parents[3] / "repro" / "suites" / "collisions"
SIDE_BY_SIDE = (COLLISIONS_SUITE / "side.py").read_text()
SIDE_CONFTEST = (COLLISIONS_SUITE / "conftest.py").read_text()

COLLIDING = """
    import contextlib
    import os

    from side import meet

    def _roundtrip(me):
        meet("started")  # both are in the test before either writes
        try:
            with open("shared-output.txt", "a") as f:  # one file in the working directory
                f.write(me)
            meet("wrote")
            assert open("shared-output.txt").read() == me
        finally:
            meet("read")  # nobody removes it while the other still reads it
            with contextlib.suppress(FileNotFoundError):
                os.remove("shared-output.txt")

    def test_writes_a():
        _roundtrip("a")

    def test_writes_b():
        _roundtrip("b")
"""


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang watchdog
def test_tests_that_collide_across_workers_are_parallel_unsafe_with_the_other_named(
    tmp_path: Path,
) -> None:
    suite = make_suite(tmp_path / "suite", side=SIDE_BY_SIDE, conftest=SIDE_CONFTEST,
                       test_collide=COLLIDING)  # fmt: skip
    out = tmp_path / "o"
    done = sweep(".", "--runs", "2", "--workers", "2", "--seed", "1", "--isolation-runs", "1",
                 "--out", str(out), *FAST,
                 cwd=suite, timeout=570)  # fmt: skip
    assert done.returncode == 1, done.stderr
    tests = by_id(summary_of(out))
    for me, other in (("a", "b"), ("b", "a")):
        test = tests[f"test_collide.py::test_writes_{me}"]
        assert (test["failures"], test["runs"]) == (2, 2), test  # xdist parts them every run
        assert test["isolation_failures"] == 0, test  # reruns alone never shared the cwd
        assert test["classification"] == "parallel-unsafe", test
        assert test["concurrent"] == [f"test_collide.py::test_writes_{other}"]
        assert test["collides_with"] == [f"test_collide.py::test_writes_{other}"]  # K of K
        assert test["polluters"] == []
    assert "parallel-unsafe" in done.stderr


PARALLEL_ONLY = """
    from side import meet

    def test_needs_no_xdist(request):
        meet("started")  # the other worker's test runs while this one does
        assert not hasattr(request.config, "workerinput")  # an xdist worker's

    def test_busy():
        meet("started")
"""


@pytest.mark.slow  # two workers side by side, then sequence and pair reruns
@pytest.mark.timeout(600)  # a hang watchdog
def test_a_parallel_only_failure_no_partner_reproduces_names_no_collision(tmp_path: Path) -> None:
    # It fails under xdist whoever runs beside it: the test beside it is listed as having
    # run at the same time, but is not named as colliding with it.
    suite = make_suite(tmp_path / "suite", side=SIDE_BY_SIDE, conftest=SIDE_CONFTEST,
                       test_x=PARALLEL_ONLY)  # fmt: skip
    out = tmp_path / "o"
    done = sweep(".", "--runs", "2", "--workers", "2", "--seed", "1", "--out", str(out), *FAST,
                 cwd=suite, timeout=570)  # fmt: skip
    test = by_id(summary_of(out))["test_x.py::test_needs_no_xdist"]
    assert test["classification"] == "parallel-unsafe", (test, done.stderr)
    assert (test["failures"], test["runs"]) == (2, 2), test
    assert test["concurrent"] == ["test_x.py::test_busy"] and test["collides_with"] == []
    assert "none of them alone made it fail 3 of 3" in test["why"]


# -- problem 6: state in a module-scoped fixture ---------------------------------------


@pytest.mark.slow  # a search among 40 tests
def test_a_state_setter_behind_a_module_scoped_fixture_is_found(tmp_path: Path) -> None:
    others = {f"test_other{i}": "\n".join(f"def test_{j}():\n    pass\n" for j in range(5))
              for i in range(8)}  # fmt: skip
    suite = make_suite(tmp_path / "suite", test_dict="""
        import pytest

        @pytest.fixture(scope="module")
        def store():
            return {}

        def test_quick_assign(store):
            store["k"] = 1

        def test_del(store):
            del store["k"]
    """, **others)  # fmt: skip
    out = tmp_path / "o"
    done = sweep(str(suite), "--runs", "2", "--workers", "0", "--seed", "4", "--out", str(out),
                 *FAST, cwd=tmp_path)  # fmt: skip
    test = by_id(summary_of(out))["test_dict.py::test_del"]
    assert test["classification"] == "brittle", (test, done.stderr)
    assert test["state_setters"] == ["test_dict.py::test_quick_assign"]


# -- problem 8: the budget does not relabel ---------------------------------------------


def test_a_test_failing_every_run_is_rerun_alone_once_per_rerun(tmp_path: Path) -> None:
    # It failed every suite run, so its reruns go straight to "no other test process alive":
    # a rerun beside others and then its confirmation cost two GPU processes per rerun.
    suite = make_suite(tmp_path / "suite", test_x="def test_always():\n    assert False\n",
                       test_y="def test_fine():\n    pass\n")  # fmt: skip
    out = tmp_path / "o"
    sweep(str(suite), "--runs", "2", "--workers", "2", "--out", str(out), *FAST, cwd=tmp_path)
    test = by_id(summary_of(out))["test_x.py::test_always"]
    assert (test["classification"], test["isolation_failures"]) == ("fail", 3), test
    replays = [p.read_text() for p in (out / "raw" / "replays").glob("alone-*.txt")]
    assert sum("test_always" in r for r in replays) == 3
    # The test that passed every run is run alone once (issue 24), and no more.
    assert sum("test_fine" in r for r in replays) == 1
    assert by_id(summary_of(out))["test_y.py::test_fine"]["isolation_runs"] == 1


def test_a_failure_the_budget_left_unrerun_is_unverified(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", test_x="def test_always():\n    assert False\n")
    out = tmp_path / "o"
    done = sweep(str(suite), "--runs", "3", "--workers", "0", "--budget", "0.01",
                 "--out", str(out), *FAST, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1
    test = by_id(summary_of(out))["test_x.py::test_always"]
    assert test["classification"] == "unverified" and test["isolation_runs"] == 0
    assert "budget" in test["why"]


# -- problem 3: every process sees the ids collection saw --------------------------------


@pytest.mark.slow  # 4 runs and a search
def test_reruns_keep_the_rootdir_and_config_when_one_path_has_its_own_pytest_ini(
    tmp_path: Path,
) -> None:
    # Swept together, `a` and `b` share the project's rootdir; a rerun of a test of `a`
    # alone would make pytest pick a/pytest.ini and a/ as rootdir (other ids) unless the
    # sweep pins both to what collection found.
    project = tmp_path / "project"
    (project / "setup.cfg").parent.mkdir()
    (project / "setup.cfg").write_text("[tool:pytest]\n")
    make_suite(project / "a", test_state="""
        STATE = []

        def test_pollute():
            STATE.append(1)

        def test_victim():
            assert not STATE
    """)  # fmt: skip
    (project / "b").mkdir()
    (project / "b" / "test_other.py").write_text("def test_fine():\n    pass\n")
    out = tmp_path / "o"
    done = sweep(str(project / "a"), str(project / "b"), "--runs", "4", "--workers", "0",
                 "--seed", "2", "--out", str(out), *FAST, cwd=tmp_path)  # fmt: skip
    tests = by_id(summary_of(out))
    assert set(tests) >= {"a/test_state.py::test_victim", "b/test_other.py::test_fine"}
    victim = tests["a/test_state.py::test_victim"]
    assert victim["classification"] == "order-dependent", (victim, done.stderr)
    assert victim["polluters"] == ["a/test_state.py::test_pollute"]
