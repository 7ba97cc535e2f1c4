"""GPU pinning (issue 14) on the CPU: a fake device list, checked through the records.

Every test process of the planted suite (pinning_suite) notes the CUDA_VISIBLE_DEVICES
it saw at conftest import and in the test; the rows must name the same device, xdist
workers round-robin, single processes round-robin, and the split of tests over devices
must follow from the seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
from pinning_suite import seen, write_suite

from capsafe_harness.plugin import gpus
from capsafe_harness.records import Record, from_json, read_records, to_json
from capsafe_harness.report import placement
from capsafe_harness.sweep.executor import SWEEP_SHARED_ENV, SWEEP_TMP_ENV
from capsafe_harness.verdicts import fold

FAST = ["-p", "no:run-parallel", "-p", "no:hypothesispytest", "-p", "no:cacheprovider"]


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    return write_suite(tmp_path / "suite")


def test_specs_resolve_against_the_devices_found() -> None:
    four = lambda: ["0", "1", "2", "3"]  # noqa: E731
    assert gpus.parse("all", four) == ("0", "1", "2", "3")
    assert gpus.parse("2", four) == ("0", "1")
    assert gpus.parse("0,2,5", four) == ("0", "2", "5")  # ids as given, found or not
    assert gpus.parse("3,", four) == ("3",)  # one device by id
    for devices in (("3",), ("0", "2")):
        assert gpus.parse(gpus.as_spec(devices), four) == devices
    assert gpus.parse("GPU-a1b2,GPU-c3d4", list) == ("GPU-a1b2", "GPU-c3d4")
    for bad, why in (("5", "1 to 4"), ("0", "1 to 4"), ("0,0", "twice"), ("0,,1", "give all")):
        with pytest.raises(gpus.GpuError, match=why):
            gpus.parse(bad, four)
    with pytest.raises(gpus.GpuError, match="no GPU found"):
        gpus.parse("all", list)


def test_all_reads_nvidia_smi_or_the_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    smi = "GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\nGPU 1: NVIDIA H200 (UUID: GPU-bbbb)\n"
    assert gpus.smi_devices(smi) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpus.detect() == ["3", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.detect() == []  # an empty list hides every device


def test_workers_round_robin() -> None:
    devices = ("0", "2", "5")
    assert [gpus.for_worker(devices, f"gw{k}") for k in range(5)] == ["0", "2", "5", "0", "2"]
    assert gpus.for_worker(devices, "main") == "0"


def test_rows_written_before_the_gpu_field_still_load() -> None:
    row = {"nodeid": "t.py::t", "phase": "call", "outcome": "passed", "duration": 0.1,
           "run_id": "r", "seed": 1, "worker": "main", "index": 0, "pid": 1, "signals": [],
           "message": "", "time": 5.0}  # fmt: skip
    loaded = from_json(json.dumps(row))
    assert loaded["gpu"] == ""
    assert from_json(to_json({**loaded, "gpu": "2"}))["gpu"] == "2"


def test_plain_pytest_pins_each_xdist_worker_before_conftest_import(
    suite: Path, tmp_path: Path
) -> None:
    def run(out: Path) -> dict[str, str]:
        out.mkdir()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "capsafe", "-n", "3",
             "--capsafe-gpus=0,1,2", "--capsafe-seed=7", f"--capsafe-records={out}", *FAST],
            cwd=suite, capture_output=True, text=True, timeout=140,
            env={**_env(), "SEEN_DIR": str(out)},
        )  # fmt: skip
        assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: on GPU 1 it breaks
        rows = [r for r in read_records(out) if r["phase"] == "call"]
        noted = seen(out)
        for row in rows:
            assert row["gpu"] == gpus.for_worker(("0", "1", "2"), row["worker"])
            assert noted[row["pid"]] == {(row["gpu"], row["gpu"])}  # one device, from import on
        return {r["nodeid"]: r["gpu"] for r in rows}

    first = run(tmp_path / "a")
    assert len(set(first.values())) == 3
    assert run(tmp_path / "b") == first  # the same seed: every test on the same device


@pytest.mark.slow  # a sweep with reruns on three pinned devices
@pytest.mark.timeout(600)
def test_sweep_pins_every_process_and_reports_the_gpu_finding(suite: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite),
         "--out", str(out), "--runs", "2", "--workers", "2", "--isolation-runs", "3",
         "--seed", "11", "--timeout", "20", "--gpus", "0,1,2", "--", *FAST],
        capture_output=True, text=True, timeout=570, env=_env(),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    rows = read_records(out / "records.jsonl")
    noted = seen(out / "raw" / "shared")
    single_processes: dict[str, str] = {}  # run id -> its one device
    for row in rows:
        assert noted[row["pid"]] == {(row["gpu"], row["gpu"])}, row
        if row["run_id"].startswith("run-"):
            assert row["gpu"] == gpus.for_worker(("0", "1", "2"), row["worker"])
        else:
            single_processes[row["run_id"]] = row["gpu"]
    singles = Counter(single_processes.values())
    assert set(singles) == {"0", "1", "2"}, singles  # every single process ran, pinned
    assert max(singles.values()) - min(singles.values()) <= 1, singles  # round-robin
    summary = json.loads((out / "summary.json").read_text())
    findings = summary["placement"]["findings"]
    assert [(f["nodeid"], f["gpu"]) for f in findings] == [
        ("test_env.py::test_broken_on_gpu_1", "1")
    ]
    assert "## Failures by GPU" in (out / "report.md").read_text()
    assert "Failures by GPU" in (out / "report.html").read_text()
    assert "placement: 1 test(s) failed on one GPU only (GPU 1)" in done.stderr


def test_failures_on_one_gpu_only_are_a_placement_finding() -> None:
    def row(nodeid: str, run: str, pid: int, gpu: str, outcome: str) -> Record:
        return cast(Record, {"nodeid": nodeid, "phase": "call", "outcome": outcome, "run_id": run,
                "pid": pid, "gpu": gpu, "signals": [], "time": 0.0, "worker": "main",
                "index": 0, "seed": None, "message": ""})  # fmt: skip

    def section_of(rows: list[Record]) -> dict[str, Any] | None:
        return placement.placement_section(fold.attempts(rows).values())

    rows = [
        row("a", "run-1", 1, "0", "passed"), row("a", "run-2", 2, "3", "failed"),
        row("a", "alone-3", 3, "3", "failed"), row("a", "alone-4", 4, "1", "passed"),
        row("b", "run-1", 1, "0", "failed"), row("b", "run-2", 2, "3", "failed"),  # two GPUs
        row("c", "run-1", 1, "3", "failed"),  # never passed elsewhere
    ]  # fmt: skip
    section = section_of(rows)
    assert section is not None
    assert section["findings"] == [
        {"nodeid": "a", "gpu": "3", "failures": 2, "attempts": 2, "passed_on": ["0", "1"]}
    ]
    assert section["gpus"]["3"] == {"attempts": 4, "failures": 4}
    text = "\n".join(placement.markdown(section))
    assert "| 3 | 4 | 4 |" in text and "`a` failed only on GPU 3" in text
    assert "<code>a</code> failed only on GPU 3" in placement.html_section(section)
    assert section_of([{**r, "gpu": ""} for r in rows]) is None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("PYTEST_XDIST_WORKER", None)  # this test's own xdist worker id is not theirs
    for name in (SWEEP_SHARED_ENV, SWEEP_TMP_ENV):  # a sweep of this suite sets them for it,
        env.pop(name, None)  # not for the planted suite (its notes would go there)
    return env


GPU_TESTS = """\
import os
import pytest
from cuda.bindings import driver

def _note():
    (err,) = driver.cuInit(0)
    err, count = driver.cuDeviceGetCount()
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    folder = os.environ["CAPSAFE_SWEEP_SHARED"]
    with open(os.path.join(folder, f"devices-{os.getpid()}.txt"), "a") as f:
        f.write(f"{seen} {count}\\n")

@pytest.mark.parametrize("k", range(6))
def test_counts_devices(k):
    _note()

def test_fails_so_it_is_rerun_alone():
    _note()
    assert False
"""


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_on_the_gpu_every_process_sees_the_one_device_of_its_row(tmp_path: Path) -> None:
    """benchmarks/run_gpu.sh's `sweep_gpus` step: --gpus all on the real machine."""
    from capsafe.backend_cuda import unavailable_reason

    if reason := unavailable_reason():
        pytest.skip(reason)
    found = gpus.detect()
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_devices.py").write_text(GPU_TESTS)
    (suite / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite),
         "--out", str(out), "--runs", "2", "--workers", "2", "--isolation-runs", "2",
         "--seed", "5", "--timeout", "60", "--gpus", "all", "--", *FAST],
        capture_output=True, text=True, timeout=570,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    counted: dict[int, set[tuple[str, int]]] = {}
    for path in (out / "raw" / "shared").glob("devices-*.txt"):
        for line in path.read_text().splitlines():
            visible, count = line.split()
            counted.setdefault(int(path.stem.split("-")[1]), set()).add((visible, int(count)))
    rows = [r for r in read_records(out / "records.jsonl") if r["phase"] == "call" and r["pid"]]
    by_gpu = Counter(r["gpu"] for r in rows)
    print(
        f"GPUs found {found}; call rows per gpu {dict(by_gpu)}; processes {len(counted)}; "
        f"(CUDA_VISIBLE_DEVICES, devices seen) {sorted(set().union(*counted.values()))}"
    )
    assert set(by_gpu) <= set(found) and by_gpu
    for row in rows:
        assert counted[row["pid"]] == {(row["gpu"], 1)}, row  # one device, the row's
