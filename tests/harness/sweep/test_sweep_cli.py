"""`capsafe sweep` usage errors: one line, exit 2, no traceback; and the help text."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NoReturn

import pytest

from capsafe.cli import main
from capsafe_harness.sweep import run
from capsafe_harness.sweep.host import pool_width
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.runner import usage_error_line


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["/no/such/dir"], "no such file or directory: /no/such/dir"),
        (["{suite}", "--runs", "0"], "--runs must be at least 1, got 0"),
        (["{suite}", "--workers", "-1"], "--workers must be at least 0, got -1"),
        (["{suite}", "--isolation-runs", "0"], "--isolation-runs must be at least 1"),
        (["{suite}", "--threads", "0"], "--threads must be at least 1"),
        (["{suite}", "--jobs", "0"], "--jobs must be at least 1, got 0"),
        (["{suite}", "--timeout", "0"], "--timeout must be positive"),
        (["{suite}", "--budget", "-5"], "--budget must be positive"),
        (["{suite}", "--baseline", "{suite}/missing.txt"], "cannot read --baseline"),
        (["{suite}", "--seed", "-3"], "--seed must be a non-negative integer"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    suite: Path, capsys: pytest.CaptureFixture[str], args: list[str], reason: str
) -> None:
    argv = ["sweep", *(a.format(suite=suite) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("capsafe sweep: ") and reason in err


def test_missing_xdist_with_workers_is_a_usage_error(
    suite: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else real(name, *a)
    )
    assert main(["sweep", str(suite), "--workers", "2"]) == 2
    assert "pytest-xdist is not installed" in capsys.readouterr().err


def test_out_that_is_a_file_is_a_usage_error(
    suite: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (suite / "f").write_text("")
    assert main(["sweep", str(suite), "--out", str(suite / "f")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_unknown_option_is_exit_2(suite: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sweep", str(suite), "--bogus"])
    assert exc.value.code == 2


def test_a_mistyped_option_prints_the_sweep_usage_and_the_near_option(
    suite: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Handed back to the top-level parser, it printed `usage: capsafe [-h] ...`."""
    with pytest.raises(SystemExit) as exc:
        main(["sweep", str(suite), "--runz", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: capsafe sweep ")
    assert err.splitlines()[-1] == (
        "capsafe sweep: error: unrecognized arguments: --runz 3 (did you mean --runs?)"
    )


def test_a_node_id_given_as_a_path_is_told_so(
    suite: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sweep", f"{suite}/test_x.py::test_x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such file" not in err
    assert f"is a test id; the sweep takes files and directories (give {suite}/test_x.py" in err


def test_missing_pytest_run_parallel_names_the_threads_extra(
    suite: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pytest_run_parallel" else real(name, *a),
    )
    assert main(["sweep", str(suite), "--threads", "2"]) == 2
    err = capsys.readouterr().err
    assert "pytest-run-parallel is not installed" in err and "'.[threads]'" in err


def test_help_explains_options_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sweep", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    usage = text.split("\n\n", 1)[0]
    assert usage.startswith("usage: capsafe sweep ") and usage.endswith(
        "[PATH ...] [-- PYTEST_ARGS ...]"
    )
    for needle in ("--runs", "--workers", "--isolation-runs", "--neighbors", "--threads",
                   "--budget", "--baseline", "exit codes", "130", "order-dependent"):  # fmt: skip
        assert needle in text


def test_out_that_cannot_be_created_is_a_usage_error(
    suite: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (suite / "f").write_text("")
    assert main(["sweep", str(suite), "--out", str(suite / "f" / "reports")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("capsafe sweep: cannot write reports into --out")


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_timeout_must_be_finite(
    suite: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert main(["sweep", str(suite), "--timeout", value, "--out", str(suite / "o")]) == 2
    assert "--timeout must be positive" in capsys.readouterr().err


def test_ctrl_c_outside_the_phases_is_one_line_and_exit_130(
    suite: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(options: object) -> NoReturn:
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_sweep", interrupted)
    assert main(["sweep", str(suite), "--out", str(suite / "o"), "--no-progress"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("capsafe sweep: interrupted")


@pytest.mark.parametrize("prog", ["pytest", "__main__.py", "python -m pytest"])
def test_pytests_usage_error_is_found_whatever_its_program_name(tmp_path: Path, prog: str) -> None:
    """pytest 9 under `python -m` names itself `python -m pytest` in its argparse error
    (a clean CI venv got it; the machine's older pytest says `__main__.py`)."""
    log = tmp_path / "run.log"
    log.write_text(f"usage: {prog} [options] [file_or_dir]\n{prog}: error: unrecognized "
                   "arguments: -n=2\n  inifile: /x/pytest.ini\n  rootdir: /x\n")  # fmt: skip
    line = usage_error_line(log)
    assert line.startswith("unrecognized arguments: -n=2") and "--workers 0" in line


def test_an_ini_without_xdist_names_pytests_error_and_workers_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pytest's exit 4 printed its error, then `inifile:` and `rootdir:` lines; the sweep
    reported the last one ("exit 4: rootdir: ..."), the cause only in the raw log."""
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:xdist\n")
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    argv = ["sweep", str(tmp_path), "--runs", "1", "--workers", "2", "--seed", "1",
            "--out", str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("capsafe sweep: pytest could not run the suite (exit 4): "
                           "unrecognized arguments: -n")  # fmt: skip
    assert "sweep with --workers 0" in last


@pytest.mark.parametrize(
    ("workers", "jobs", "cpus", "width", "neighbors"),
    [
        (2, None, 2, 2, 0),  # a 2-core machine: the runs' workers, as before --jobs
        (2, None, 16, 8, 0),  # a 16-core host: half its CPUs
        (2, None, 16, 2, 2),  # with neighbour threads (a GPU suite): the workers
        (2, 6, 16, 6, 2),
        (2, None, 64, 8, 0),  # at most 8 by default
        (12, None, 16, 12, 0),  # never fewer than the runs' workers
        (0, None, 16, 4, 0),  # without xdist: min(4, CPUs)
        (0, None, 1, 1, 0),
        (2, 3, 16, 3, 0),  # --jobs decides
    ],
)
def test_replay_processes_at_once_follow_jobs_workers_and_the_cpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, workers: int, jobs: int | None, cpus: int,
    width: int, neighbors: int,
) -> None:  # fmt: skip
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    options = SweepOptions(paths=(tmp_path,), out=tmp_path / "out", seed=1, workers=workers,
                           jobs=jobs, neighbors=neighbors)  # fmt: skip
    assert pool_width(options) == width
