"""`--capsafe-forked`: each test runs in a forked child, so a test that cannot run twice in
one process can be repeated (harness.plugin.forked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsafe_harness.records import read_records

pytest_plugins = ["pytester"]

# python-fs's test_addpath, in small: the module is importable only once its directory is
# on sys.path, so a second run in the same process finds it imported and fails.
IMPORT_ONCE = """
import os
import sys
import pytest

HERE = os.path.join(os.path.dirname(__file__), "late")

def test_import_once():
    os.makedirs(HERE, exist_ok=True)
    with open(os.path.join(HERE, "late_module.py"), "w") as f:
        f.write("VALUE = 1\\n")
    with pytest.raises(ImportError):
        import late_module
    sys.path.insert(0, HERE)
    import late_module
    assert late_module.VALUE == 1
"""

# Every setup and teardown, of each level, appends its name and pid to a log.
LOGGED = """
import os
import pytest

LOG = os.path.join(os.path.dirname(__file__), "events.log")

def log(event):
    with open(LOG, "a") as f:
        f.write(f"{event} {os.getpid()}\\n")

def setup_module(module): log("setup_module")
def teardown_module(module): log("teardown_module")

@pytest.fixture(scope="session", autouse=True)
def session_fixture():
    log("session up")
    yield
    log("session down")

def test_one(): log("one")
def test_fails(): log("fails"); assert False
def test_dies(): log("dies"); os._exit(7)
"""


def run_replay(
    pytester: pytest.Pytester, tmp_path: Path, module: str, order: list[str], *args: str
) -> pytest.RunResult:
    pytester.makepyfile(test_m=module)
    tmp_path.mkdir(parents=True, exist_ok=True)
    replay = tmp_path / "replay.txt"
    replay.write_text("".join(f"test_m.py::{name}\n" for name in order))
    return pytester.runpytest_subprocess(
        "-p", "no:xdist", "-p", "no:cacheprovider", f"--capsafe-replay={replay}",
        f"--capsafe-records={tmp_path / 'records'}", *args,
    )  # fmt: skip


def events(pytester: pytest.Pytester) -> list[tuple[str, int]]:
    lines = (pytester.path / "events.log").read_text().splitlines()
    return [(line.rsplit(" ", 1)[0], int(line.rsplit(" ", 1)[1])) for line in lines]


def test_a_test_that_cannot_run_twice_in_a_process_repeats_forked(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    in_process = run_replay(pytester, tmp_path / "a", IMPORT_ONCE, ["test_import_once"] * 4)
    assert in_process.ret == 1  # the second run finds the module imported: DID NOT RAISE
    forked = run_replay(pytester, tmp_path / "b", IMPORT_ONCE, ["test_import_once"] * 4,
                        "--capsafe-forked")  # fmt: skip
    assert forked.ret == 0, forked.stdout.str()
    calls = [r for r in read_records(tmp_path / "b" / "records") if r["phase"] == "call"]
    assert [r["outcome"] for r in calls] == ["passed"] * 4  # each child wrote its own rows


def test_each_forked_repetition_sets_up_and_tears_down_everything_in_its_child(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    done = run_replay(pytester, tmp_path, LOGGED, ["test_one"] * 3, "--capsafe-forked")
    assert done.ret == 0
    seen = events(pytester)
    once = ["session up", "setup_module", "one", "teardown_module", "session down"]
    assert [e for e, _ in seen] == once * 3
    children = [pid for _, pid in seen]
    assert len(set(children)) == 3  # one child per repetition, all of its events in it
    assert all(children[i] == children[i - i % 5] for i in range(len(children)))


def test_a_failing_child_stops_the_process_at_its_first_failure(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    # The sweep's pair runs stop the test's side at its first failure (-x): a child's
    # failure must count in the parent, which ran no test itself.
    done = run_replay(pytester, tmp_path, LOGGED, ["test_one", "test_fails", "test_one"],
                      "--capsafe-forked", "-x")  # fmt: skip
    assert done.ret == 1
    assert [e for e, _ in events(pytester) if e in ("one", "fails")] == ["one", "fails"]


def test_a_child_that_dies_counts_as_a_failure(pytester: pytest.Pytester, tmp_path: Path) -> None:
    done = run_replay(pytester, tmp_path, LOGGED, ["test_dies", "test_one"], "--capsafe-forked",
                      "-x")  # fmt: skip
    assert done.ret == 1
    assert [e for e, _ in events(pytester) if e in ("one", "dies")] == ["dies"]


def test_forked_refuses_neighbour_threads(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m="def test_one(): pass\n")
    done = pytester.runpytest_subprocess("-p", "no:xdist", "--capsafe-forked",
                                         "--capsafe-neighbors=1")  # fmt: skip
    assert done.ret == pytest.ExitCode.USAGE_ERROR
    done.stderr.fnmatch_lines(["*--capsafe-forked: cannot run with --capsafe-neighbors*"])


def test_a_child_that_hangs_reports_its_own_timeout(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    # pytest-timeout's alarm fires in the parent first (it was set before the fork): the
    # parent waits for the child's own, which fails the test there and writes its rows.
    hang = "import time\ndef test_hang():\n    time.sleep(60)\ndef test_one(): pass\n"
    done = run_replay(pytester, tmp_path, hang, ["test_hang", "test_one"], "--capsafe-forked",
                      "--timeout=1", "--timeout-method=signal")  # fmt: skip
    assert done.ret == 1, done.stdout.str()
    rows = {(r["nodeid"], r["phase"]): r for r in read_records(tmp_path / "records")}
    assert rows[("test_m.py::test_hang", "call")]["signals"] == ["timeout"]
    assert rows[("test_m.py::test_one", "call")]["outcome"] == "passed"  # the process went on
