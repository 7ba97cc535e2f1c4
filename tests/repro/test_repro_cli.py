"""The reproducers' shared command-line plumbing survives bad output paths and bad trials."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from capsafe import hazards
from capsafe.handles import CaptureMode, StreamKind
from capsafe_repro import cli, hazard_matrix


def test_unwritable_json_path_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "taken").write_text("")
    target = tmp_path / "taken" / "result.json"
    assert cli.run_main(lambda: cli.finish({}, target, True), "capsafe_repro.x") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"capsafe_repro.x: cannot write --json {target}: ")


@pytest.mark.parametrize("stdout", ["Segmentation fault?\n", "42\n"])
def test_a_trial_that_prints_no_result_is_an_error_row(
    monkeypatch: pytest.MonkeyPatch, stdout: str
) -> None:
    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 0, stdout=stdout, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)  # the module hazard_matrix calls
    cell = ("ctx_sync", CaptureMode.GLOBAL, StreamKind.NONBLOCKING, hazards.SAME_THREAD,
            hazards.SAME_DEVICE, hazards.ACTIVE)  # fmt: skip
    row = hazard_matrix._in_fresh_process("sim")(cell)
    assert row["end_capture"] == "ERROR"
    assert row["call_result"].startswith("ERROR(trial printed no result")
