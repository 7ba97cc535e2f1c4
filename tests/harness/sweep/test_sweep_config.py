"""`[tool.capsafe]` in pyproject.toml: read as the sweep's defaults, overridden by flags,
a bad key or value one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsafe.cli import main
from capsafe_harness.sweep import run
from capsafe_harness.sweep.options import SweepOptions


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "quarantine.txt").write_text("tests/test_x.py::test_x\n")
    monkeypatch.chdir(tmp_path / "tests")  # the file is found above the current directory
    return tmp_path


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[SweepOptions]:
    """The options each sweep was started with (none runs)."""
    seen: list[SweepOptions] = []

    def record(options: SweepOptions) -> run.SweepResult:
        seen.append(options)
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_sweep", record)
    return seen


def _write(project: Path, table: str) -> None:
    (project / "pyproject.toml").write_text(f"[project]\nname = 'x'\n\n[tool.capsafe]\n{table}")


TABLE = """\
paths = ["tests"]
runs = 7
workers = 0
seed = 11
timeout = 30
isolation_runs = 2
neighbors = 1
out = "reports/nightly"
baseline = "quarantine.txt"
junitxml = "reports/junit.xml"
no-progress = true
fix = true
pytest-args = ["-m", "not slow"]
"""


def test_table_gives_every_default(
    project: Path, started: list[SweepOptions], capsys: pytest.CaptureFixture[str]
) -> None:
    _write(project, TABLE)
    assert main(["sweep"]) == 130
    (o,) = started
    assert o.paths == ((project / "tests").resolve(),)
    assert (o.runs, o.workers, o.seed, o.timeout, o.isolation_runs, o.neighbors) == (
        7, 0, 11, 30.0, 2, 1,
    )  # fmt: skip
    assert o.out == (project / "reports" / "nightly").resolve()
    assert o.baseline == frozenset({"tests/test_x.py::test_x"})
    assert o.junitxml == (project / "reports" / "junit.xml").resolve()
    assert o.progress is False
    assert o.fix is True  # the fixing phase, a project's default (issue 25)
    assert o.pytest_args == ("-m", "not slow")
    assert f"config={project / 'pyproject.toml'} [tool.capsafe]" in capsys.readouterr().err


def test_flags_override_the_table(project: Path, started: list[SweepOptions]) -> None:
    _write(project, TABLE)
    other = project / "other"
    other.mkdir()
    args = ["sweep", str(other), "--runs", "2", "--workers", "1", "--seed", "5",
            "--timeout", "9", "--out", str(project / "o"), "--", "-k", "x"]  # fmt: skip
    assert main(args) == 130
    (o,) = started
    assert o.paths == (other.resolve(),)
    assert (o.runs, o.workers, o.seed, o.timeout) == (2, 1, 5, 9.0)
    assert o.out == (project / "o").resolve()
    assert o.pytest_args == ("-k", "x")
    assert o.isolation_runs == 2  # not given as a flag: still the table's


def test_no_table_changes_nothing(project: Path, started: list[SweepOptions]) -> None:
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert main(["sweep", "--out", str(project / "o")]) == 130
    (o,) = started
    assert (o.runs, o.timeout, o.isolation_runs, o.pytest_args, o.fix) == (5, 60.0, 3, (), False)


@pytest.mark.parametrize(
    ("table", "reason"),
    [
        ("rnus = 3\n", "[tool.capsafe] rnus: unknown key (known: "),
        ("runs = 'many'\n", "[tool.capsafe] runs: 'many' is not a valid value"),
        ("runs = true\n", "[tool.capsafe] runs: give a string or a number"),
        ("executor = 'k8s'\n", "executor: 'k8s' is not one of local, ray"),
        ("no-progress = 1\n", "no-progress: give true or false"),
        ("paths = 'tests'\n", "paths: give a list of strings"),
        ("resume = true\n", "resume: --resume is a command-line flag only"),
        ("runs = 0\n", "--runs must be at least 1, got 0"),
        ("runs = [\n", "cannot read"),
    ],
)
def test_bad_table_is_one_line_and_exit_2(
    project: Path,
    started: list[SweepOptions],
    capsys: pytest.CaptureFixture[str],
    table: str,
    reason: str,
) -> None:
    _write(project, table)
    assert main(["sweep", "--out", str(project / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("capsafe sweep: ") and reason in err
    assert not started
