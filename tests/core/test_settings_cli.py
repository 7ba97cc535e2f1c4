"""Every command parses capsafe's settings the same way: a bad value is one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from capsafe import backend_cuda

ROOT = Path(__file__).resolve().parents[2]
CAPSAFE = [sys.executable, "-m", "capsafe.cli"]
BOGUS_LINE = "capsafe: CAPSAFE_BACKEND='bogus' is not valid; use one of: cuda, sim, auto"


def _run(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CAPSAFE_")}
    return subprocess.run(
        command, env={**clean, **env}, capture_output=True, text=True, timeout=240, cwd=ROOT
    )


@pytest.mark.parametrize(
    "command",
    [
        [*CAPSAFE, "sweep", "repro/suites/polluter", "--runs", "1"],
        [*CAPSAFE, "repro", "frozen_config"],
        [*CAPSAFE, "cache", "stats"],
        [sys.executable, "-m", "capsafe_repro.hazard_matrix"],
        [sys.executable, "-m", "capsafe_repro.capture_race"],
    ],
    ids=["sweep", "repro", "cache", "hazard_matrix", "capture_race"],
)
def test_an_unknown_backend_is_the_same_line_and_exit_2_everywhere(command: list[str]) -> None:
    result = _run(command, CAPSAFE_BACKEND="bogus")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == BOGUS_LINE
    assert result.stdout == ""


def test_too_many_simulated_devices_is_one_line_and_exit_2_before_any_work() -> None:
    """10^6 simulated devices took 7-10 s and 320 MB before the first call; now refused."""
    result = _run(
        [sys.executable, "-m", "capsafe_repro.hazard_matrix"],
        CAPSAFE_BACKEND="sim",
        CAPSAFE_SIM_DEVICES="1000000",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "capsafe: CAPSAFE_SIM_DEVICES='1000000' is not valid; "
        "use a whole number of devices, 1 to 64"
    )
    assert result.stdout == ""


@pytest.mark.skipif(backend_cuda.unavailable_reason() is None, reason="a GPU answers here")
def test_hazard_matrix_honours_capsafe_backend_cuda_without_a_gpu() -> None:
    result = _run([sys.executable, "-m", "capsafe_repro.hazard_matrix"], CAPSAFE_BACKEND="cuda")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "needs a GPU" in result.stderr
    assert "disagreement" not in result.stdout
