"""Under PYTHONDONTWRITEBYTECODE the sweep's test processes keep their bytecode (assertion
rewrites included) in the sweep's raw/pycache, never in the project's tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from capsafe_harness.sweep.bytecode import PYCACHE, bytecode_env


def test_only_a_user_who_writes_no_bytecode_and_set_no_prefix_gets_the_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    assert bytecode_env(tmp_path) == {}  # bytecode goes where Python puts it anyway
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert bytecode_env(tmp_path) == {
        "PYTHONDONTWRITEBYTECODE": "",
        "PYTHONPYCACHEPREFIX": str(tmp_path / PYCACHE),
    }
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "mine"))
    assert bytecode_env(tmp_path) == {}  # the user's own choice stands


def test_a_sweep_keeps_its_rewritten_test_modules_out_of_the_project(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPSAFE_", "PYTEST_"))}
    env.pop("PYTHONPYCACHEPREFIX", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", str(suite), "--runs", "1", "--workers",
         "0", "--no-progress", "--out", str(out), "--", "-p", "no:run-parallel"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rewritten = list((out / "raw" / PYCACHE).rglob("test_ok.*-pytest-*.pyc"))
    assert rewritten, "the suite's rewritten test module is not in raw/pycache"
    assert not list(suite.rglob("__pycache__"))
