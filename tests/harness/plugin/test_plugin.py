"""The capsafe pytest plugin: records, order, replay, signals, crash rows, neighbours."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from capsafe_harness.plugin import order
from capsafe_harness.records import (
    DETAILS_LIMIT,
    MESSAGE_LIMIT,
    MESSAGE_LINES,
    Record,
    Signal,
    fold_outcome,
    from_json,
    load_records,
    read_records,
)

pytest_plugins = ["pytester"]
RunLean = Callable[..., pytest.RunResult]

SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"
KEYS = set(Record.__annotations__) - {"env_leak", "captures", "thread_unsafe"}

THREE_MODULES = {
    "test_a": "import pytest\n@pytest.mark.parametrize('i', range(5))\ndef test_a(i): pass\n",
    "test_b": "import pytest\n@pytest.mark.parametrize('i', range(5))\ndef test_b(i): pass\n",
    "test_c": "def test_c1(): pass\ndef test_c2(): pass\n",
}


def rows_by_phase(directory: Path, phase: str = "call") -> list[Record]:
    rows = [r for r in read_records(directory) if r["phase"] == phase]
    return sorted(rows, key=lambda r: (r["worker"], r["index"]))


@pytest.fixture
def run_lean(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> RunLean:
    """Subprocess runs with only this plugin and xdist loaded: other plugins' start-up
    (and pytest-run-parallel's numpy import) would dominate these tests."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest_subprocess(
            "-p", "xdist.plugin", "-p", "capsafe_harness.plugin", *args
        )

    return run


def collected(pytester: pytest.Pytester, *args: str) -> list[str]:
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:xdist", *args)
    return [line for line in result.outlines if "::" in line]


def test_records_have_every_key_and_true_positions(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(
        test_rec="""
        import pytest
        def test_ok(): pass
        def test_bad(): assert 0, "planted failure"
        def test_skipped(): pytest.skip("not today")
        """
    )
    result = pytester.runpytest(
        "-p", "no:xdist", f"--capsafe-records={tmp_path}", "--capsafe-seed=7"
    )
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["capsafe: seed=7 shuffle=global*"])
    rows = read_records(tmp_path)
    assert len(rows) == 9  # three tests, three phases each
    assert all(set(row) >= KEYS for row in rows)
    (path,) = tmp_path.glob("records-*.jsonl")
    run_id, _, pid = path.stem.split("-")[1:]
    assert {(r["run_id"], r["worker"], r["pid"], r["seed"]) for r in rows} == {
        (run_id, "main", int(pid), 7)
    }
    calls = rows_by_phase(tmp_path)
    assert [r["index"] for r in calls] == [0, 1, 2]
    assert [r["nodeid"] for r in calls] == order.shuffled(
        ["test_rec.py::test_ok", "test_rec.py::test_bad", "test_rec.py::test_skipped"], 7, "global"
    )
    by_id = {r["nodeid"].split("::")[1]: r for r in calls}
    assert by_id["test_bad"]["outcome"] == "failed"
    assert "planted failure" in by_id["test_bad"]["message"]
    assert by_id["test_ok"]["message"] == ""
    assert by_id["test_skipped"]["outcome"] == "skipped"


def test_no_options_register_nothing_per_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "def test_x(request):\n"
        "    assert not request.config.pluginmanager.get_plugin('capsafe-run')\n"
    )
    result = pytester.runpytest("-p", "no:xdist")
    result.assert_outcomes(passed=1)
    assert "capsafe:" not in result.stdout.str()


def test_shuffle_reproducible_per_seed_and_mode(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**THREE_MODULES)
    plain = collected(pytester)
    first, again = (
        collected(pytester, "--capsafe-seed=11"),
        collected(pytester, "--capsafe-seed=11"),
    )
    other = collected(pytester, "--capsafe-seed=12")
    assert first == again == order.shuffled(plain, 11, "global")
    assert sorted(first) == sorted(plain) and first != plain and other != first
    by_module = collected(pytester, "--capsafe-seed=11", "--capsafe-shuffle=module")
    modules = [order.module_of(n) for n in by_module]
    assert modules == sorted(modules, key=modules.index)  # each module's tests stay together
    assert collected(pytester, "--capsafe-seed=11", "--capsafe-shuffle=none") == plain


def test_random_is_reseeded_per_test(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(
        test_rand=f"""
        import random
        def test_draw(request):
            with open({str(tmp_path / "draws")!r}, "a") as f:
                f.write(f"{{request.node.nodeid}} {{random.random()}}\\n")
        def test_other(): random.random()
        """
    )
    for seed in ("5", "5", "6"):
        pytester.runpytest("-p", "no:xdist", f"--capsafe-seed={seed}").assert_outcomes(passed=2)
    draws = (tmp_path / "draws").read_text().splitlines()
    assert draws[0] == draws[1] != draws[2]


def test_xdist_workers_follow_one_shuffled_order(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    pytester.makepyfile(**THREE_MODULES)
    plain = collected(pytester)
    result = run_lean("-n", "2", "--capsafe-seed=random", f"--capsafe-records={tmp_path}")
    result.assert_outcomes(passed=len(plain))
    calls = rows_by_phase(tmp_path)
    (seed,) = {r["seed"] for r in calls}
    assert seed is not None
    assert {r["worker"] for r in calls} == {"gw0", "gw1"}
    assert len({r["run_id"] for r in calls}) == 1
    expected = order.shuffled(plain, seed, "global")
    for worker in ("gw0", "gw1"):
        seen = [r["nodeid"] for r in calls if r["worker"] == worker]
        assert [r["index"] for r in calls if r["worker"] == worker] == list(range(len(seen)))
        assert seen == [n for n in expected if n in seen]  # a subsequence of the one order


def test_replay_runs_exactly_the_listed_ids_in_order(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(**THREE_MODULES)
    wanted = ["test_c.py::test_c2", "test_a.py::test_a[3]", "test_b.py::test_b[0]"]
    replay = tmp_path / "replay.txt"
    replay.write_text("# a worker's sequence\n" + "\n".join(wanted) + "\n\n")
    records = tmp_path / "rec"
    result = pytester.runpytest(
        "-p", "no:xdist", f"--capsafe-replay={replay}", f"--capsafe-records={records}"
    )
    result.assert_outcomes(passed=3, deselected=9)
    assert [r["nodeid"] for r in rows_by_phase(records)] == wanted


def test_replay_refuses_unknown_ids_and_xdist(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(**THREE_MODULES)
    replay = tmp_path / "replay.txt"
    replay.write_text("test_a.py::test_a[0]\ntest_a.py::test_gone\n")
    result = pytester.runpytest("-p", "no:xdist", f"--capsafe-replay={replay}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*1 listed test(s) were not collected: test_a.py::test_gone*"])
    result = pytester.runpytest("-n", "2", f"--capsafe-replay={replay}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*add -n 0*"])


def test_replay_file_after_a_space_names_the_equals_form(
    pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """pytest takes `--capsafe-replay FILE`'s FILE for a test path when choosing its rootdir
    (before plugins load); a file outside the project moves it. The error says to use `=`."""
    pytester.makepyfile(**THREE_MODULES)
    replay = tmp_path_factory.mktemp("elsewhere") / "replay.txt"
    replay.write_text("test_a.py::test_a[0]\n")
    result = pytester.runpytest("-p", "no:xdist", "--capsafe-replay", str(replay))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*write --capsafe-replay={replay}*"])
    result = pytester.runpytest("-p", "no:xdist", f"--capsafe-replay={replay}")
    result.assert_outcomes(passed=1, deselected=11)


def test_env_leak_is_recorded_only_when_not_restored(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(
        test_env="""
        import os
        def test_leaks(): os.environ["CAPSAFE_PLANTED_LEAK"] = "1"
        def test_restores(monkeypatch): monkeypatch.setenv("CAPSAFE_PLANTED_OTHER", "1")
        def test_unwatched(): os.environ["PLANTED_UNWATCHED"] = "1"
        """
    )
    try:
        pytester.runpytest("-p", "no:xdist", f"--capsafe-records={tmp_path}").assert_outcomes(
            passed=3
        )
    finally:  # the leaking test ran in this process: undo it for the tests after this one
        import os

        os.environ.pop("CAPSAFE_PLANTED_LEAK", None)
        os.environ.pop("PLANTED_UNWATCHED", None)
    leaks = {
        r["nodeid"].split("::")[1]: r.get("env_leak")
        for r in rows_by_phase(tmp_path, "teardown")
        if "env-leak" in r["signals"]
    }
    assert leaks == {"test_leaks": {"CAPSAFE_PLANTED_LEAK": [None, "1"]}}


def test_every_variable_is_watched_with_a_star(pytester: pytest.Pytester, tmp_path: Path) -> None:
    # The sweep's alone run of every test watches them all: a test that leaves any variable
    # set is a candidate polluter (issue 24: accessify's DISABLE_ACCESSIFY).
    pytester.makepyfile(test_env='import os\ndef test_x(): os.environ["PLANTED_ANY"] = "1"\n')
    try:
        pytester.runpytest("-p", "no:xdist", f"--capsafe-records={tmp_path}",
                           "--capsafe-watch-env=*").assert_outcomes(passed=1)  # fmt: skip
    finally:
        import os

        os.environ.pop("PLANTED_ANY", None)
    (row,) = [r for r in rows_by_phase(tmp_path, "teardown") if "env-leak" in r["signals"]]
    assert row["env_leak"] == {"PLANTED_ANY": [None, "1"]}


def test_signals_come_from_failure_text_and_exception_types(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(
        test_sig="""
        import time
        import pytest
        from capsafe.errors import CaptureInvalidated
        class ProjectFrozenError(Exception):
            pass
        class FrozenConfigError(ProjectFrozenError):
            pass
        class Renamed(CaptureInvalidated):
            pass
        def test_raw_cuda_text(): raise RuntimeError("cudaErrorStreamCaptureInvalidated")
        def test_subclass(): raise Renamed("CUDA_ERROR_X", "cuStreamEndCapture")
        def test_frozen(): raise FrozenConfigError("moved")
        @pytest.mark.timeout(0.2, method="signal")
        def test_hangs(): time.sleep(5)
        def test_plain(): assert 0
        """
    )
    pytester.runpytest("-p", "no:xdist", f"--capsafe-records={tmp_path}").assert_outcomes(failed=5)
    signals = {r["nodeid"].split("::")[1]: r["signals"] for r in rows_by_phase(tmp_path)}
    assert signals == {
        "test_raw_cuda_text": ["capture-invalidated"],
        "test_subclass": ["capture-invalidated"],
        "test_frozen": ["frozen-config"],
        "test_hangs": ["timeout"],
        "test_plain": [],
    }


def test_crashed_worker_gets_a_crash_row(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    pytester.makepyfile(test_die="import os\ndef test_ok(): pass\ndef test_die(): os._exit(1)\n")
    result = run_lean(
        "-n",
        "1",
        "--capsafe-seed=0",
        "--capsafe-shuffle=none",
        f"--capsafe-records={tmp_path}",
    )
    result.assert_outcomes(passed=1, failed=1)
    rows = read_records(tmp_path)
    (crash,) = [r for r in rows if "crash" in r["signals"]]
    assert crash["nodeid"] == "test_die.py::test_die" and crash["outcome"] == "failed"
    assert crash["worker"] == "gw0" and crash["index"] == 1
    assert crash["message"].startswith("worker 'gw0' crashed while running")
    (setup,) = [r for r in rows if r["nodeid"] == crash["nodeid"] and r["phase"] == "setup"]
    assert crash["pid"] == setup["pid"] and crash["run_id"] == setup["run_id"]


def test_worker_crashes_come_from_xdists_hook_with_the_dead_workers_pid(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    """Each test that kills its own worker (os._exit, SIGKILL) gets one crash row, with the
    pid of the process it died in (the replacement worker's for the second); a test whose
    failure merely quotes xdist's crash line is an ordinary failure, not a crash."""
    pids = tmp_path / "pids"
    pids.mkdir()
    pytester.makepyfile(
        test_die=f"""
import os, pathlib, signal
def _note(name):
    pathlib.Path({str(pids)!r}, name).write_text(str(os.getpid()))
def test_a_exit():
    _note("test_a_exit")
    os._exit(3)
def test_b_sigkill():
    _note("test_b_sigkill")
    os.kill(os.getpid(), signal.SIGKILL)
def test_c_quotes():
    assert False, "worker 'gw7' crashed while running 'x.py::y'"
"""
    )
    records = tmp_path / "records"
    result = run_lean("-n", "1", "--capsafe-seed=0", "--capsafe-shuffle=none",
                      f"--capsafe-records={records}")  # fmt: skip
    result.assert_outcomes(failed=3)
    rows = read_records(records)
    crashes = {r["nodeid"].split("::")[1]: r for r in rows if "crash" in r["signals"]}
    assert sorted(crashes) == ["test_a_exit", "test_b_sigkill"]
    for name, crash in crashes.items():
        assert crash["pid"] == int((pids / name).read_text()), name
        assert crash["outcome"] == "failed" and crash["phase"] == "call"
    assert crashes["test_a_exit"]["pid"] != crashes["test_b_sigkill"]["pid"]
    quoted = [r for r in rows if r["nodeid"].endswith("test_c_quotes")]
    assert quoted and all(r["signals"] == [] for r in quoted)


def test_neighbors_break_raw_captures_not_gated_ones(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    suite = SUITES / "capture"
    args = [f"--capsafe-records={tmp_path}", "--rootdir", str(suite), "--capsafe-neighbors=2"]
    result = run_lean(str(suite), *args)
    result.assert_outcomes(passed=1, failed=1)
    assert "neighbors=2" in result.stdout.str()
    assert "neighbour thread problem" not in result.stdout.str()
    calls = {r["nodeid"]: r for r in rows_by_phase(tmp_path)}
    raw = calls["test_capture.py::test_raw_global_capture"]
    # Its own window's end raised: the failure came from inside its capture.
    assert raw["outcome"] == "failed"
    assert raw["signals"] == [Signal.CAPTURE_INVALIDATED, Signal.FAILED_IN_CAPTURE]
    assert calls["test_capture.py::test_protected_capture"]["outcome"] == "passed"


def test_plugin_imports_nothing_heavy(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    pytester.makepyfile(
        """
        import sys
        def test_modules():
            heavy = {"pandas", "numpy", "cuda", "cuda.bindings", "tqdm"} & set(sys.modules)
            assert not heavy, heavy
        """
    )
    result = run_lean("-n", "0", "--capsafe-seed=1", f"--capsafe-records={tmp_path}")
    result.assert_outcomes(passed=1)
    assert len(read_records(tmp_path)) == 3


def test_reader_skips_malformed_lines(tmp_path: Path) -> None:
    good = {k: 0 for k in KEYS} | {"phase": "call", "outcome": "passed", "signals": []}
    lines = [
        json.dumps(good),
        "not json",
        "[1, 2]",
        json.dumps({"nodeid": "x"}),
        json.dumps(good | {"outcome": "exploded"}),
        '{"nodeid": "a", "ph',
    ]
    (tmp_path / "records-r-gw0-1.jsonl").write_text("\n".join(lines))
    (tmp_path / "unrelated.txt").write_text("ignored")
    rows, skipped = load_records(tmp_path)
    assert rows == [good] and skipped == 5
    assert read_records(tmp_path / "records-r-gw0-1.jsonl") == [good]
    assert read_records(tmp_path / "missing") == []


def test_unusable_records_dir_or_replay_file_is_a_usage_error(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makepyfile(test_x="def test_x(): pass\n")
    a_file = tmp_path / "taken"
    a_file.write_text("")
    result = pytester.runpytest("-p", "no:xdist", f"--capsafe-records={a_file}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--capsafe-records: cannot create {a_file}: *"])
    binary = tmp_path / "replay.txt"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    result = pytester.runpytest("-p", "no:xdist", f"--capsafe-replay={binary}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--capsafe-replay: cannot read {binary}: *"])
    assert "Traceback" not in result.stderr.str()


def test_outcomes_messages_and_times_of_every_kind_of_result(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Problem 10: skipped, xfailed and xpassed are their own outcomes (not pass), each
    non-pass row carries its first lines and the full text, and every phase its times."""
    pytester.makepyfile(
        test_kinds="""
        import pytest
        def test_ok(): pass
        def test_bad():
            lines = "\\n".join(f"line {i}" for i in range(40))
            assert 0, lines + "x" * 9000
        def test_skipped(): pytest.skip("not today")
        @pytest.mark.xfail(reason="known bug")
        def test_xfailed(): assert 0, "still broken"
        @pytest.mark.xfail(reason="fixed upstream")
        def test_xpassed(): pass
        """
    )
    result = pytester.runpytest("-p", "no:xdist", f"--capsafe-records={tmp_path}")
    result.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1, xpassed=1)
    rows = read_records(tmp_path)
    by_test: dict[str, list[Record]] = {}
    for r in rows:
        by_test.setdefault(r["nodeid"].split("::")[1], []).append(r)
    outcome = {name: fold_outcome(r["outcome"] for r in rs) for name, rs in by_test.items()}
    assert outcome == {
        "test_ok": "passed",
        "test_bad": "failed",
        "test_skipped": "skipped",
        "test_xfailed": "xfailed",
        "test_xpassed": "xpassed",
    }
    calls = {r["nodeid"].split("::")[1]: r for r in rows_by_phase(tmp_path)}
    bad = calls["test_bad"]
    assert bad["message"].startswith("AssertionError: line 0\n")
    assert len(bad["message"].splitlines()) == MESSAGE_LINES and "line 5" not in bad["message"]
    assert len(bad["message"]) <= MESSAGE_LIMIT
    assert len(bad["details"]) == DETAILS_LIMIT and "AssertionError" in bad["details"]
    assert calls["test_xfailed"]["message"].startswith("expected to fail (known bug): ")
    assert "still broken" in calls["test_xfailed"]["message"]
    assert "fixed upstream" in calls["test_xpassed"]["message"]
    (skip_row,) = [r for r in by_test["test_skipped"] if r["outcome"] == "skipped"]
    assert "not today" in skip_row["message"]
    assert calls["test_ok"]["message"] == calls["test_ok"]["details"] == ""
    for rs in by_test.values():
        phases = sorted(rs, key=lambda r: PHASE_ORDER.index(r["phase"]))
        assert all(r["start"] <= r["stop"] <= r["time"] for r in phases)
        assert all(a["stop"] <= b["start"] for a, b in itertools.pairwise(phases))


PHASE_ORDER = ("setup", "call", "teardown")


def test_rows_of_the_older_format_read_with_defaults(tmp_path: Path) -> None:
    old = {
        "nodeid": "t.py::t", "phase": "call", "outcome": "failed", "duration": 0.5,
        "run_id": "r", "seed": None, "worker": "gw0", "index": 0, "pid": 1,
        "signals": [], "message": "boom", "time": 100.0,
    }  # fmt: skip
    row = from_json(json.dumps(old))
    assert row["details"] == "boom"
    assert (row["start"], row["stop"]) == (99.5, 100.0)


def test_fold_outcome_puts_failure_first_then_xfail_results_then_skip() -> None:
    assert fold_outcome(["passed", "failed", "skipped"]) == "failed"
    assert fold_outcome(["passed", "xfailed", "passed"]) == "xfailed"
    assert fold_outcome(["skipped", "passed"]) == "skipped"
    assert fold_outcome(["passed", "passed", "passed"]) == "passed"
    assert fold_outcome([]) == "passed"
