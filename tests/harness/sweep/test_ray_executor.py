"""`capsafe sweep --executor ray` against a local Ray instance this module starts (issue 14).

The same planted suite, the same seed, the local and the Ray executor: the same verdict
for every test. A test that kills the Ray worker running its process: the task runs
once more, then that test is recorded as crashed on that node, and the sweep goes on.
Run with `pytest -m ray tests/harness/sweep/test_ray_executor.py -p no:cacheprovider`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pinning_suite import seen, write_suite

from capsafe_harness.plugin.order import write_replay
from capsafe_harness.records import Phase, Record, read_records, to_json
from capsafe_harness.sweep.executor import Exit, Launch
from capsafe_harness.sweep.options import SweepError, SweepOptions
from capsafe_harness.sweep.ray_executor import NOT_INSTALLED, RayExecutor
from capsafe_harness.sweep.runner import Runner

pytestmark = pytest.mark.ray

SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"
FAST = ["--", "-p", "no:run-parallel", "-p", "no:hypothesispytest"]

# Kills the Ray worker that started this pytest process (its parent), only under Ray:
# under the local executor the parent is the sweep, which must never be hit. It kills
# mid-test, once its setup row has streamed to the sweep: the sweep writes what a task
# streams into raw/RUN_ID/ (emptied at each attempt's start), beside raw/shared.
KILL_WORKER = """\
import os
import signal
import sys
import time
from pathlib import Path

def _setup_streamed():
    run_id = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--capsafe-run-id="))
    raw = Path(os.environ["CAPSAFE_SWEEP_SHARED"]).parent / run_id
    return any(b'"phase":"setup"' in p.read_bytes() for p in raw.glob("*.jsonl"))

def _kill_the_ray_worker():
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    if parent.startswith(b"ray::"):  # a Ray worker names itself after its task
        give_up = time.monotonic() + 120  # a hang watchdog: it streams in 50 ms
        while not _setup_streamed() and time.monotonic() < give_up:
            time.sleep(0.05)
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(1)
"""
EVERY_TIME = """
def test_kills_its_worker_every_time():
    _kill_the_ray_worker()
"""
ONCE = """
def test_kills_its_worker_once():
    marker = Path(os.environ["CAPSAFE_SWEEP_SHARED"]) / "killed-once"
    if not marker.exists():
        marker.write_text("")
        _kill_the_ray_worker()
"""


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
    # two GPUs declared, none present: Ray hands them out (CUDA_VISIBLE_DEVICES) all the same
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        address: str = ray.get_runtime_context().gcs_address
        yield address
    finally:
        ray.shutdown()


def _sweep(suite: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite),
         "--out", str(out), *args, *FAST],  # the default --timeout: 60 s, a hang watchdog
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip


def _verdicts(out: Path) -> dict[str, tuple[str, list[str], list[str]]]:
    tests = json.loads((out / "summary.json").read_text())["tests"]
    return {t["nodeid"]: (t["classification"], t["polluters"], t["state_setters"]) for t in tests}


@pytest.mark.timeout(600)
def test_ray_sweep_classifies_every_test_as_the_local_one(ray_address: str, tmp_path: Path) -> None:
    suite = SUITES / "polluter"
    options = ["--runs", "2", "--workers", "0", "--seed", "3", "--isolation-runs", "1"]
    local = _sweep(suite, tmp_path / "local", *options)
    remote = _sweep(suite, tmp_path / "ray", *options, "--executor", "ray",
                    "--address", ray_address)  # fmt: skip
    assert (local.returncode, remote.returncode) == (1, 1), remote.stderr
    assert _verdicts(tmp_path / "ray") == _verdicts(tmp_path / "local")
    assert _verdicts(tmp_path / "ray")["test_lookup.py::test_registry_starts_empty"][0] == (
        "order-dependent"
    )

    # the same processes left the same evidence in raw/, records and logs
    def names(out: Path) -> list[str]:  # the same processes (the local sweep's fork
        # servers keep their own logs beside them: Ray runs every process fresh)
        return sorted(p.name for p in (out / "raw").iterdir() if p.name != "fork-servers")

    assert names(tmp_path / "ray") == names(tmp_path / "local")
    assert "passed" in (tmp_path / "ray" / "raw" / "run-1.log").read_text()


@pytest.mark.timeout(600)
def test_a_worker_lost_twice_is_a_crash_of_its_test_on_that_node(
    ray_address: str, tmp_path: Path
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_killer.py").write_text(KILL_WORKER + EVERY_TIME)
    (suite / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "report"
    done = _sweep(suite, out, "--runs", "1", "--workers", "0", "--seed", "1",
                  "--isolation-runs", "1", "--executor", "ray",
                  "--address", ray_address)  # fmt: skip
    assert done.returncode == 1, done.stderr
    killer = "test_killer.py::test_kills_its_worker_every_time"
    test = {t["nodeid"]: t for t in json.loads((out / "summary.json").read_text())["tests"]}[killer]
    assert (test["classification"], test["signals"]) == ("fail", ["crash"])
    assert test["message"].startswith("lost with Ray node")
    processes = json.loads((out / "sweep.json").read_text())["processes"]
    lost = {n for n, fact in processes.items() if "lost with Ray node" in fact.get("lost", "")}
    assert lost == {"run-1", "alone-1"}
    log = (out / "raw" / "run-1.log").read_text()
    assert "run-1 attempt 1 on Ray node" in log and "run again" in log
    assert "WorkerCrashedError" in log


@pytest.mark.timeout(600)
def test_a_worker_lost_once_is_run_again_and_only_the_rerun_counts(
    ray_address: str, tmp_path: Path
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_killer.py").write_text(KILL_WORKER + ONCE)
    (raw := tmp_path / "raw" / "shared").mkdir(parents=True)
    records = tmp_path / "raw" / "run-1"
    cmd = (sys.executable, "-m", "pytest", "test_killer.py", "-p", "capsafe",
           f"--capsafe-records={records}", "--capsafe-run-id=run-1", "-p", "no:xdist",
           "-q", "-p", "no:cacheprovider")  # fmt: skip
    launch = Launch("run-1", cmd, suite, {"CAPSAFE_SWEEP_SHARED": str(raw)}, records,
                    tmp_path / "raw" / "run-1.log", 60.0)  # fmt: skip
    finished: list[int] = []
    end = RayExecutor.connect(ray_address).execute(launch, finished.append, threading.Event())
    assert (end.returncode, end.lost, end.interrupted) == (0, "", False)
    rows = read_records(records)
    assert [(r["phase"], r["outcome"]) for r in rows] == [
        ("setup", "passed"), ("call", "passed"), ("teardown", "passed")
    ]  # fmt: skip
    assert sum(finished) == 1
    log = launch.log.read_text()
    assert "attempt 1 on Ray node" in log and "1 passed" in log
    assert log.splitlines()[1].startswith("capsafe: run-1 runs on Ray node ")  # after the note


def test_without_ray_installed_the_sweep_says_so_in_one_line(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "ray.py").write_text("raise ImportError('ray is not installed here')\n")
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", str(SUITES / "polluter"), "--out",
         str(tmp_path / "out"), "--executor", "ray"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(hidden)},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"capsafe sweep: {NOT_INSTALLED}"]


def test_an_unreachable_address_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _sweep(SUITES / "polluter", tmp_path / "out", "--executor", "ray",
                  "--address", f"127.0.0.1:{port}")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"capsafe sweep: --address 127.0.0.1:{port}: no Ray cluster reachable there "
        "(Connection refused)"
    ]


def test_gpus_on_a_cluster_without_any_is_one_line(
    ray_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(
        SweepError, match=r"^--gpus with --executor ray: the Ray cluster has no GPU"
    ):
        RayExecutor.connect(ray_address, gpus=True)


@pytest.mark.timeout(600)
def test_each_ray_task_is_pinned_to_the_gpu_ray_gave_it(ray_address: str, tmp_path: Path) -> None:
    suite = write_suite(tmp_path / "suite")
    out = tmp_path / "report"
    done = _sweep(suite, out, "--runs", "1", "--workers", "2", "--isolation-runs", "2",
                  "--seed", "11", "--gpus", "0,1", "--executor", "ray",
                  "--address", ray_address)  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    rows = read_records(out / "records.jsonl")
    noted = seen(out / "raw" / "shared")
    assert rows and {r["gpu"] for r in rows} <= {"0", "1"}
    for row in rows:
        assert noted[row["pid"]] == {(row["gpu"], row["gpu"])}, row  # Ray's one device


SLEEPER = """\
import os
import time
from pathlib import Path

def test_sleeps():
    Path(os.environ["CAPSAFE_SWEEP_SHARED"], "pid").write_text(str(os.getpid()))
    time.sleep(600)
"""


@pytest.mark.timeout(600)
def test_ctrl_c_cancels_the_task_and_kills_its_test_process(
    ray_address: str, tmp_path: Path
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_sleeper.py").write_text(SLEEPER)
    out = tmp_path / "report"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite), "--out",
         str(out), "--runs", "1", "--workers", "0", "--executor", "ray", "--address",
         ray_address, *FAST],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pid_file = out / "raw" / "shared" / "pid"
    deadline = time.monotonic() + 280
    while not pid_file.exists() and time.monotonic() < deadline and sweep.poll() is None:
        time.sleep(0.2)
    assert sweep.stderr is not None  # stderr=PIPE
    assert pid_file.exists(), sweep.stderr.read() if sweep.poll() is not None else "no start"
    test_pid = int(pid_file.read_text())
    # SIGTERM takes the Ctrl-C path (termination.py); SIGINT is ignored where this runs as a
    # shell's background job, which starts children with it ignored (a clean CI, 2026-12-03).
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(timeout=280) == 130
    for _ in range(600):  # the task's watchdog kills the test process as the cancel lands
        try:
            os.kill(test_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(test_pid, signal.SIGKILL)
        pytest.fail("the test process outlived the sweep's Ctrl-C")
    assert "interrupted" in (out / "report.md").read_text()


class _LostAfterOneTest:
    """An executor whose node is lost after the first test of a replay finished."""

    def execute(
        self, launch: Launch, on_tests: Callable[[int], None], stopping: threading.Event
    ) -> Exit:
        phases: tuple[Phase, ...] = ("setup", "call", "teardown")
        rows: list[Record] = [
            {"nodeid": "a.py::t1", "phase": phase, "outcome": "passed", "duration": 0.0,
             "run_id": launch.label, "seed": 1, "worker": "main", "index": 0, "pid": 7,
             "signals": [], "message": "", "details": "", "start": 1.0, "stop": 1.0,
             "time": 1.0, "gpu": ""}
            for phase in phases
        ]  # fmt: skip
        text = "".join(to_json(r) + "\n" for r in rows)
        (launch.records / "records-replay-1-main-7.jsonl").write_text(text)
        return Exit(-9, lost="lost with Ray node n1 (NodeDiedError), run 2 times")

    def kill_all(self) -> None:
        pass


def test_a_lost_replay_without_a_row_in_flight_crashes_its_first_unfinished_test(
    tmp_path: Path,
) -> None:
    options = SweepOptions(paths=(tmp_path,), out=tmp_path / "out", seed=1, gpus=("3",))
    runner = Runner(options, tmp_path / "raw", executor=_LostAfterOneTest())
    replay = tmp_path / "replay.txt"
    write_replay(replay, ["a.py::t1", "a.py::t2", "a.py::t3"])
    cmd = runner.pytest_command(["a.py"], tmp_path / "raw" / "replay-1", "replay-1", seed=1,
                                workers=0, replay_file=replay)  # fmt: skip
    result = runner.run("replay-1", cmd, sequence=["a.py::t1", "a.py::t2", "a.py::t3"])
    assert not any("crash" in r["signals"] for r in result.rows)  # no row is made up
    crashed = [a for a in result.attempts().values() if "crash" in a.signals]
    assert [(a.nodeid, a.index, a.gpu) for a in crashed] == [("a.py::t2", 1, "3")]
    assert crashed[0].message.startswith("lost with Ray node n1")
