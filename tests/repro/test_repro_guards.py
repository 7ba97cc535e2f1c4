"""The guard reproducers show what they claim on the simulated device, each in its own process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from capsafe_repro import cli

ROOT = Path(__file__).resolve().parents[2]


def _run(
    args: list[str], tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSAFE_")}
    env["CAPSAFE_BACKEND"] = "sim"
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, *args, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_default_stream_race_is_stale_without_and_clean_with_test_stream(tmp_path: Path) -> None:
    done, result = _run(["-m", "capsafe_repro.default_stream_race", "--trials", "4"], tmp_path)
    assert result["ok"] is True
    assert result["backend"].startswith("sim")
    racy, safe = result["legacy_stream_read"], result["test_stream"]
    assert racy["stale_trials"] == racy["trials"] == 4
    assert racy["stale_bytes"] == 4 * racy["bytes_per_trial"]
    assert safe["stale_bytes"] == 0
    assert "TestStream removed the race" in done.stdout


@pytest.mark.timeout(300)
def test_frozen_config_shows_the_silent_phase_the_guard_and_the_remedy(tmp_path: Path) -> None:
    done, result = _run(["-m", "capsafe_repro.frozen_config"], tmp_path)
    assert result["one_process_without_guard"] == ["fast", "fast"]
    assert "MYAPP_KERNEL: frozen 'fast', now 'slow'" in result["guard_error"]
    assert [child["kernel"] for child in result["child_per_phase"]] == ["fast", "slow"]
    assert [child["capsafe_backend"] for child in result["child_per_phase"]] == ["sim", "sim"]
    assert "FrozenConfigError" in done.stdout


@pytest.mark.timeout(300)
def test_context_warmup_fails_alone_and_passes_after_the_state_setter(tmp_path: Path) -> None:
    _done, result = _run(["-m", "capsafe_repro.context_warmup", "--backend", "sim"], tmp_path)
    alone, warmed, fixed = result["scenarios"].values()
    assert [o["passed"] for o in alone] == [False]
    assert "CUDA_ERROR_INVALID_CONTEXT" in alone[0]["error"]
    assert [o["passed"] for o in warmed] == [True, True]
    assert [o["passed"] for o in fixed] == [True]


def test_the_repro_command_discovers_reproducers() -> None:
    found = cli.reproducers()
    assert {"default_stream_race", "frozen_config", "context_warmup"} <= set(found)
    assert "cli" not in found
    assert found["frozen_config"].startswith("A second configuration phase")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="capsafe")
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_the_repro_command_lists_and_refuses_unknown_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.run(_parse(["repro"])) == 0
    assert "default_stream_race" in capsys.readouterr().out
    assert cli.run(_parse(["repro", "no_such_thing"])) == 2
    assert "no reproducer 'no_such_thing'" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_the_repro_command_passes_arguments_through(tmp_path: Path) -> None:
    out = tmp_path / "fc.json"
    args = _parse(["repro", "capsafe_repro.frozen_config", "--json", str(out), "--backend", "sim"])
    assert args.args == ["--json", str(out), "--backend", "sim"]
    assert cli.run(args) == 0
    assert json.loads(out.read_text())["ok"] is True
