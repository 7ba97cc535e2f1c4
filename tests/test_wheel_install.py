"""capsafe installed from its wheel, the way it lands in other people's environments.

A pytest plugin is loaded into every pytest run of an environment, so a project
that never asked for capsafe must see no difference: its own `harness` and
`repro` packages still import, and pytest prints what it printed before, apart
from pytest's own list of installed plugins. Then, from the same installed
wheel, `capsafe sweep` must still find the planted polluter.

These tests build the wheel and fresh virtual environments from PyPI (about a
minute); they are marked `install` and run by `.ci/run`, and skip with a reason
when PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import venv
from importlib.metadata import version
from pathlib import Path

import pytest
from wheel_build import ROOT, build_wheel, pypi_reason

pytestmark = [pytest.mark.install, pytest.mark.timeout(600)]

PYTEST = f"pytest=={version('pytest')}"

PROJECT = {
    "harness/__init__.py": "NAME = 'their harness'\n",
    "harness/plugin.py": "def helper():\n    return 'their plugin module'\n",
    "repro/__init__.py": "NAME = 'their repro'\n",
    "tests/test_theirs.py": (
        "import harness, harness.plugin, repro\n\n"
        "def test_their_packages_import():\n"
        "    assert harness.NAME == 'their harness' and repro.NAME == 'their repro'\n"
        "    assert harness.plugin.helper() == 'their plugin module'\n\n"
        "def test_plain():\n"
        "    assert 1 + 1 == 2\n"
    ),
}


def _run(command: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPSAFE_", "PYTEST_"))}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=540)


def _venv(where: Path, *requirements: str) -> Path:
    venv.create(where, with_pip=True)
    python = where / "bin" / "python"
    done = _run([str(python), "-m", "pip", "install", "-q", *requirements], cwd=where)
    assert done.returncode == 0, done.stdout + done.stderr
    return python


def _normalized(output: str) -> list[str]:
    """pytest's output without what changes between two runs of the same suite."""
    lines = []
    for line in output.splitlines():
        line = re.sub(r" in \d+\.\d+s", " in Ns", line)
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = pypi_reason()
    if reason:
        pytest.skip(reason)
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installs_capsafe_names_only(wheel: Path) -> None:
    import zipfile

    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    packages = {top for top in tops if not top.endswith((".dist-info", ".data"))}
    assert packages == {"capsafe", "capsafe_harness", "capsafe_repro"}
    installed = set(zipfile.ZipFile(wheel).namelist())
    tree = {"capsafe": "capsafe", "harness": "capsafe_harness", "repro": "capsafe_repro"}
    expected = {
        f"{name}/{module.relative_to(ROOT / directory).as_posix()}"
        for directory, name in tree.items()
        for module in (ROOT / directory).rglob("*.py")
        if "suites" not in module.relative_to(ROOT / directory).parts
    }
    assert not expected - installed, "modules missing from the wheel"
    # PEP 561: mypy checks a project's calls into capsafe against capsafe's hints.
    assert {f"{name}/py.typed" for name in tree.values()} <= installed
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in installed)
    templates = {
        f"capsafe_harness/{t.relative_to(ROOT / 'harness').as_posix()}"
        for t in (ROOT / "harness").rglob("templates/*")
    }
    assert templates and templates <= installed, "the report's templates are package data"


def test_a_project_with_its_own_harness_and_repro_is_unchanged(wheel: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    for relative, text in PROJECT.items():
        (project / relative).parent.mkdir(parents=True, exist_ok=True)
        (project / relative).write_text(text)

    plain = _venv(tmp_path / "plain", PYTEST)
    with_capsafe = _venv(tmp_path / "with", PYTEST, str(wheel))
    before = _run([str(plain), "-m", "pytest"], cwd=project)
    after = _run([str(with_capsafe), "-m", "pytest"], cwd=project)

    assert before.returncode == 0, before.stdout + before.stderr
    assert after.returncode == 0, after.stdout + after.stderr
    assert before.stderr == after.stderr == ""
    added = [line for line in _normalized(after.stdout) if line not in _normalized(before.stdout)]
    # pytest itself lists every installed plugin (capsafe's, and those of its dependencies,
    # e.g. platformdirs' fixture plugin); that line is the only difference.
    assert len(added) == 1 and added[0].startswith("plugins: "), after.stdout
    assert f"capsafe-{version('capsafe')}" in added[0].split(": ", 1)[1].split(", ")
    kept = [line for line in _normalized(after.stdout) if not line.startswith("plugins: ")]
    assert kept == _normalized(before.stdout)


def test_the_installed_wheel_sweeps_the_planted_polluter(wheel: Path, tmp_path: Path) -> None:
    python = _venv(tmp_path / "env", f"{wheel}[harness]")
    suite = tmp_path / "polluter"
    shutil.copytree(ROOT / "repro" / "suites" / "polluter", suite)
    key = json.loads((suite / "answer_key.json").read_text())
    capsafe = python.parent / "capsafe"
    done = _run(
        [str(capsafe), "sweep", ".", "--runs", "4", "--workers", "2", "--seed", "3",
         "--out", str(tmp_path / "out"), "--no-progress"],
        cwd=suite,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    verdicts = {test["nodeid"]: test for test in summary["tests"]}
    for nodeid, expected in key["tests"].items():
        assert verdicts[nodeid]["classification"] == expected["classification"]
        assert verdicts[nodeid]["polluters"] == expected["polluters"]
