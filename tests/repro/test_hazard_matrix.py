"""The hazard-matrix reproducer on the simulated device, and the table against measured rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from capsafe import driver, hazards
from capsafe.handles import CaptureMode, StreamKind
from capsafe.hazards import Cell
from capsafe_repro import hazard_matrix

DATA = Path(__file__).resolve().parents[2] / "docs" / "data"
# Every H200 run of the matrix, the dated folders' too (other probes' rows have other schemas).
MEASURED = sorted(DATA.rglob("hazard*.jsonl"))


def _measured_rows(path: Path) -> list[dict[str, str]]:
    """Rows of a measured file in the reproducer's schema (older files say op/where/op_result)."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        rows.append(
            {
                "call": raw.get("call", raw.get("op")),
                "mode": raw["mode"].lower(),
                "stream": raw["stream"],
                "caller": raw.get("caller", raw.get("where")),
                "device": raw.get("device", hazards.SAME_DEVICE),
                "state": raw.get("state", hazards.ACTIVE),
                "call_result": raw.get("call_result", raw.get("op_result")),
                "end_capture": raw["end_capture"],
            }
        )
    return rows


def test_sim_matrix_agrees_with_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.jsonl"
    assert hazard_matrix.main(["--backend", "sim", "--compare", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert (
        len(rows) == len(list(hazards.cells())) == 336
    )  # 28 calls x 3 modes x 2 streams x 2 callers
    assert all(set(hazard_matrix.KEYS) <= row.keys() for row in rows)
    cells = {
        (r["call"], r["mode"], r["stream"], r["caller"], r["device"], r["state"]) for r in rows
    }
    assert cells == {(c, m.value, s.value, w, d, st) for c, m, s, w, d, st in hazards.cells()}
    printed = capsys.readouterr().out
    assert "0 disagreement(s)" in printed.splitlines()[-1]
    for call in hazards.CALLS:
        assert any(line.startswith(call + " ") for line in printed.splitlines())


@pytest.mark.parametrize("path", MEASURED, ids=[str(p.relative_to(DATA)) for p in MEASURED])
def test_table_reproduces_every_measured_row(path: Path) -> None:
    rows = _measured_rows(path)
    assert rows, f"{path.name} is empty"
    found = hazard_matrix.disagreements(rows)
    assert not found, "\n".join(d.describe() for d in found)


def test_compare_exits_1_and_lists_each_disagreement(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def measured(
        cells: Sequence[Cell], backend_name: str, *, jobs: int, in_process: bool
    ) -> list[dict[str, str]]:
        rows = [hazard_matrix._row(cell, hazards.SUCCESS, hazards.SUCCESS) for cell in cells]
        rows[0]["end_capture"] = hazards.INVALIDATED  # noop, yet the capture broke
        return rows

    monkeypatch.setattr(hazard_matrix, "run_matrix", measured)
    assert hazard_matrix.main(["--compare", "--calls", "noop,ctx_sync"]) == 1
    out, err = capsys.readouterr()
    listed = [line for line in err.splitlines() if line.startswith("  ")]
    assert len(listed) == 1 + 12  # the broken noop cell and every ctx_sync cell
    assert "noop global nonblocking same_thread: measured ok/INV" in listed[0]
    assert "ok/INV*" in out and "ok*" in out


def test_without_compare_a_disagreement_still_exits_0(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(cells: Sequence[Cell], *args: object, **kwargs: object) -> list[dict[str, str]]:
        return [hazard_matrix._row(c, "CUDA_ERROR_UNKNOWN", "ERROR") for c in cells]

    monkeypatch.setattr(hazard_matrix, "run_matrix", failing)
    assert hazard_matrix.main(["--calls", "noop"]) == 0


def test_codes_are_compact() -> None:
    assert hazard_matrix._code(hazards.SUCCESS, hazards.SUCCESS) == "ok"
    assert hazard_matrix._code(hazards.UNSUPPORTED, hazards.INVALIDATED) == "UNSUP"
    assert hazard_matrix._code(hazards.IMPLICIT, hazards.INVALIDATED) == "IMPL"
    assert hazard_matrix._code(hazards.SUCCESS, hazards.INVALIDATED) == "ok/INV"
    assert hazard_matrix._code("CUDA_ERROR_NOT_READY", hazards.SUCCESS) == "NOT_READY/ok"


def test_one_trial_in_its_own_process() -> None:
    command = [sys.executable, "-m", "capsafe_repro.hazard_matrix", "--backend", "sim"]
    command += ["--trial", "ctx_sync", "relaxed", "blocking", "other_thread"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["call_result"] == hazards.UNSUPPORTED
    assert row["end_capture"] == hazards.INVALIDATED


@pytest.mark.parametrize(
    "argv",
    [["--calls", "noop,bogus"], ["--jobs", "0"], ["--trial", "noop", "eager", "blocking", "x"]],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        hazard_matrix.main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cuda_backend_without_a_gpu_is_one_line_exit_2() -> None:
    from capsafe.backend_cuda import unavailable_reason

    if unavailable_reason() is None:
        pytest.skip("this machine has a GPU")
    command = [sys.executable, "-m", "capsafe_repro.hazard_matrix", "--backend", "cuda"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=dict(os.environ)
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: --backend cuda needs a GPU")
    assert len(done.stderr.strip().splitlines()) == 1


def _matrix(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The reproducer in a fresh process (its settings freeze there), CAPSAFE_* from `env`."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("CAPSAFE_")}
    child.update(env)
    command = [sys.executable, "-m", "capsafe_repro.hazard_matrix", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=child)


def test_cross_device_matrix_on_two_simulated_devices_agrees(tmp_path: Path) -> None:
    out = tmp_path / "cross.jsonl"
    done = _matrix(
        "--backend", "sim", "--cross-device", "--compare", "--json", str(out),
        CAPSAFE_SIM_DEVICES="2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 336 and {r["device"] for r in rows} == {hazards.OTHER_DEVICE}
    last = done.stdout.strip().splitlines()[-1]
    assert "capture on device 0 and call on device 1" in last
    assert "0 disagreement(s)" in last and "predictions until measured" in last
    assert not hazard_matrix.disagreements(rows)


@pytest.mark.parametrize("devices", ["1", None])
def test_cross_device_with_one_simulated_device_is_one_line_exit_2(devices: str | None) -> None:
    done = _matrix(
        "--backend",
        "sim",
        "--cross-device",
        **({"CAPSAFE_SIM_DEVICES": devices} if devices else {}),
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: --cross-device needs 2 devices, this machine has 1")
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_cross_device_on_a_one_gpu_machine_is_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from capsafe.sim import SimBackend

    class OneGpu(SimBackend):
        name = "cuda"

    monkeypatch.setattr(hazard_matrix, "unavailable_reason", lambda: None)
    monkeypatch.setattr(driver, "create_backend", lambda name: (OneGpu(), "test"))
    assert hazard_matrix.main(["--backend", "cuda", "--cross-device", "--compare"]) == 2
    out, err = capsys.readouterr()
    assert err == "error: --cross-device needs 2 devices, this machine has 1\n" and out == ""


def test_one_cross_device_trial_in_its_own_process() -> None:
    argv = ["--backend", "sim", "--trial", "ctx_sync", "relaxed", "blocking", "other_thread"]
    same = json.loads(_matrix(*argv).stdout.strip().splitlines()[-1])
    cross = _matrix(*argv, "--cross-device", CAPSAFE_SIM_DEVICES="2")
    assert cross.returncode == 0, cross.stderr
    row = json.loads(cross.stdout.strip().splitlines()[-1])
    assert (same["device"], same["call_result"]) == (hazards.SAME_DEVICE, hazards.UNSUPPORTED)
    assert (row["device"], row["call_result"]) == (hazards.OTHER_DEVICE, hazards.SUCCESS)
    assert row["end_capture"] == hazards.SUCCESS  # device 1's sync does not wait on device 0


def test_a_row_is_compared_with_the_rules_of_its_device() -> None:
    row = hazard_matrix._row(
        (
            "memcpy_htod",
            CaptureMode.GLOBAL,
            StreamKind.BLOCKING,
            "other_thread",
            hazards.SAME_DEVICE,
            hazards.ACTIVE,
        ),
        hazards.SUCCESS,
        hazards.SUCCESS,
    )
    (found,) = hazard_matrix.disagreements([row])  # on its own device it is IMPLICIT
    assert "memcpy_htod global blocking other_thread: measured ok" in found.describe()
    cross = {**row, "device": hazards.OTHER_DEVICE}
    assert hazard_matrix.disagreements([cross]) == []
    del row["device"]  # rows measured before the device axis are same-device rows
    assert len(hazard_matrix.disagreements([row])) == 1
    del row["state"]  # and rows measured before the state axis are of active captures
    assert len(hazard_matrix.disagreements([row])) == 1


def test_a_row_is_compared_with_the_rules_of_its_state() -> None:
    """Another thread's cuMemAlloc beside a GLOBAL capture left open: refused (the H200 probe
    of 2026-12-01), and the capture ends INVALIDATED whatever the call returned."""
    cell = (
        "mem_alloc",
        CaptureMode.GLOBAL,
        StreamKind.NONBLOCKING,
        hazards.OTHER_THREAD,
        hazards.SAME_DEVICE,
        hazards.LEFT_OPEN,
    )
    refused = hazard_matrix._row(cell, hazards.UNSUPPORTED, hazards.INVALIDATED)
    assert hazard_matrix.disagreements([refused]) == []
    allowed = hazard_matrix._row(cell, hazards.SUCCESS, hazards.INVALIDATED)
    (found,) = hazard_matrix.disagreements([allowed])
    assert "mem_alloc global nonblocking other_thread left_open: measured ok (" in found.describe()
    assert hazard_matrix._code(hazards.SUCCESS, hazards.INVALIDATED, hazards.LEFT_OPEN) == "ok"
    assert hazard_matrix._code(hazards.SUCCESS, hazards.SUCCESS, hazards.LEFT_OPEN) == "ok/ok"


def test_left_open_matrix_on_the_sim_agrees(tmp_path: Path) -> None:
    out = tmp_path / "left_open.jsonl"
    done = _matrix("--backend", "sim", "--left-open", "--compare", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 336 and {r["state"] for r in rows} == {hazards.LEFT_OPEN}
    assert {r["end_capture"] for r in rows} == {hazards.INVALIDATED}
    assert not hazard_matrix.disagreements(rows)
    refused = {(r["call"], r["mode"], r["caller"]) for r in rows if r["stream"] == "nonblocking"
               and r["call_result"] != hazards.SUCCESS}  # fmt: skip
    assert ("mem_alloc", "global", hazards.OTHER_THREAD) in refused
    assert ("mem_alloc", "relaxed", hazards.OTHER_THREAD) not in refused
    assert {("ctx_sync", m.value, hazards.OTHER_THREAD) for m in CaptureMode} <= refused
    printed = done.stdout.strip().splitlines()
    assert "an invalidated capture left open" in printed[-1]
    assert "0 disagreement(s)" in printed[-1]
    assert hazard_matrix.LEFT_OPEN_LEGEND in printed


def test_left_open_cross_device_matrix_on_two_simulated_devices_agrees(tmp_path: Path) -> None:
    out = tmp_path / "left_open_cross.jsonl"
    done = _matrix(
        "--backend", "sim", "--left-open", "--cross-device", "--compare", "--json", str(out),
        CAPSAFE_SIM_DEVICES="2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["device"], r["state"]) for r in rows} == {(hazards.OTHER_DEVICE, hazards.LEFT_OPEN)}
    assert len(rows) == 336 and not hazard_matrix.disagreements(rows)


def test_one_left_open_trial_in_its_own_process() -> None:
    argv = ["--backend", "sim", "--trial", "mem_alloc", "global", "nonblocking", "other_thread"]
    done = _matrix(*argv, "--left-open")
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert (row["state"], row["call_result"]) == (hazards.LEFT_OPEN, hazards.UNSUPPORTED)
    assert row["end_capture"] == hazards.INVALIDATED


def test_docs_carry_the_current_rule_table() -> None:
    docs = (DATA.parent / "hazards.md").read_text()
    assert hazard_matrix.rules_markdown() in docs, (
        "docs/hazards.md is stale: paste `python -m capsafe_repro.hazard_matrix --rules` into it"
    )


def test_a_trial_killed_by_a_signal_is_rerun_once(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([-11, 0])
    cell = (
        "noop",
        CaptureMode.GLOBAL,
        StreamKind.BLOCKING,
        "same_thread",
        hazards.SAME_DEVICE,
        hazards.ACTIVE,
    )

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        code = next(answers)
        row = hazard_matrix._row(cell, "CUDA_SUCCESS", "CUDA_SUCCESS")
        out = json.dumps(row) if code == 0 else ""
        return subprocess.CompletedProcess(command, code, stdout=out, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)  # the module hazard_matrix calls
    run = hazard_matrix._in_fresh_process("sim")
    row = run(cell)
    # An int, though hazard_matrix.Row says every value is a str.
    assert int(row["reruns"]) == 1 and row["call_result"] == hazards.SUCCESS
    assert "1 trial(s) rerun" in hazard_matrix.summary_line([row], "sim", 0.0)
