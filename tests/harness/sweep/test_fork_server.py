"""The fork server (issue 21): a replay forked from a collected pytest is a fresh replay.

The fresh process stays the reference: the same launch, built by the sweep's Runner,
runs once through `LocalExecutor` (a new interpreter) and once through `ForkExecutor`
(a child of a fork server), and the rows must agree on everything but pids and times.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from forked_suites import CRASHES_WHEN_FORKED, write_suite

from capsafe_harness.plugin import order
from capsafe_harness.records import Record, load_records
from capsafe_harness.sweep import fork_checks
from capsafe_harness.sweep.executor import (
    OUTER_PYTEST_VARIABLES,
    LocalExecutor,
    inherited_environ,
)
from capsafe_harness.sweep.fork_client import ForkServer, Refused
from capsafe_harness.sweep.fork_executor import ForkExecutor, split_replay
from capsafe_harness.sweep.fork_server import Job
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.run import Sweep
from capsafe_harness.sweep.runner import ProcessResult, Runner
from capsafe_harness.sweep.state import prepare_out

SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"
PLANTED = sorted(p.parent.name for p in SUITES.glob("*/answer_key.json"))
QUIET = ("-p", "no:run-parallel", "-p", "no:hypothesispytest")
#: Planted suites whose collection makes capsafe's driver (a conftest's fake framework over
#: driver.raw()): the server refuses them, since a child's capsafe would get a new driver.
MADE_DRIVER = "capsafe's driver (sim backend) was made at import or collection"
REFUSED = {"cuda_core_capture": MADE_DRIVER}
TIMEOUT = 3.0  # pytest-timeout in the replays: the hang suite's test waits this long


def make_runner(suite: Path, raw: Path, executor: LocalExecutor) -> Runner:
    options = SweepOptions(paths=(suite,), out=raw.parent, seed=1, timeout=TIMEOUT,
                           invoked_from=suite, pytest_args=QUIET, progress=False)  # fmt: skip
    runner = Runner(options, raw, executor=executor)
    runner.rootdir, runner.inifile = suite, str(suite / "pytest.ini")
    return runner


def replay(
    runner: Runner, label: str, sequence: Sequence[str], seed: int | None,
    extra: Sequence[str] = (),
) -> ProcessResult:  # fmt: skip
    """One replay as the sweep's phases run it (host.SweepHost.replay)."""
    replay_file = runner.raw / "replays" / f"{label}.txt"
    order.write_replay(replay_file, sequence)
    cmd = runner.pytest_command(runner.replay_targets(sequence), runner.raw / label, label,
                                seed=seed, workers=0, replay_file=replay_file,
                                extra=extra)  # fmt: skip
    return runner.run(label, cmd)


def comparable(rows: Sequence[Record]) -> list[tuple[Any, ...]]:
    """A row without what differs between any two processes: pids, times, durations."""
    return [
        (r["nodeid"], r["phase"], r["outcome"], r["index"], r["run_id"], r["seed"],
         r["worker"], tuple(r["signals"]), r["message"], r.get("env_leak"))
        for r in sorted(rows, key=lambda r: (r["index"], r["nodeid"], r["time"]))
    ]  # fmt: skip


@pytest.fixture
def forks(tmp_path: Path) -> Iterator[ForkExecutor]:
    # A hang watchdog, not a speed limit: a loaded 2-core CI machine starts pytest slowly.
    executor = ForkExecutor([os.curdir], tmp_path / "servers", start_timeout=300)
    yield executor
    executor.close()


def collected(suite: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *QUIET, "-p", "no:xdist"],
        cwd=suite, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", PLANTED)
def test_a_forked_replay_writes_the_rows_a_fresh_one_does(
    name: str, tmp_path: Path, forks: ForkExecutor
) -> None:
    suite = SUITES / name
    sequence = order.shuffled(collected(suite), 7, "global")
    assert sequence
    results = []
    for path, executor in (("fresh", LocalExecutor()), ("forked", forks)):
        runner = make_runner(suite, tmp_path / path / "raw", executor)
        results.append(replay(runner, "alone-1", sequence, seed=7))
    fresh, forked = results
    if name in REFUSED:  # run fresh, with the reason
        assert list(forks.refusals.values()) == [REFUSED[name]]
        assert (forks.forked, forks.fresh) == (0, 1)
    else:
        assert forks.refusals == {}
        assert (forks.forked, forks.fresh) == (1, 0)
    assert comparable(forked.rows) == comparable(fresh.rows)
    assert forked.returncode == fresh.returncode
    assert forked.killed_in == fresh.killed_in


#: Planted suites whose suite runs stay under xdist, with the report's reason.
UNDER_XDIST = {
    "import_once": "the suite reads xdist's worker variables before its tests run "
    "(conftest.py:14), which a forked worker sets only after",  # its rendezvous
}
CRASH_EVERY_RUN = {"crash"}  # no xdist run ends cleanly to check the plan against


def sweep_summary(suite: Path, out: Path, fork: bool) -> tuple[dict[str, Any], list[str]]:
    """A whole sweep of a planted suite with its answer key's options: each test's
    verdict, and the fork server's notes (none for a fresh sweep)."""
    key = json.loads((suite / "answer_key.json").read_text())
    chosen = {"timeout": 10, **key.get("sweep", {})}  # as test_planted_suites: the key's win
    options = SweepOptions(paths=(suite,), out=out, invoked_from=suite, pytest_args=QUIET,
                           progress=False, fork=fork, **chosen)  # fmt: skip
    prepare_out(out, resume=False, force=False)
    Sweep(options).execute()
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {t["nodeid"]: (t["classification"], t["polluters"], t["state_setters"],
                              sorted(t["signals"])) for t in summary["tests"]}  # fmt: skip
    return verdicts, [n for n in summary["notes"] if n.startswith("fork server")]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", PLANTED)
def test_a_sweep_with_the_fork_server_gives_the_summary_a_fresh_one_does(
    name: str, tmp_path: Path
) -> None:
    fresh, _ = sweep_summary(SUITES / name, tmp_path / "fresh", fork=False)
    forked, notes = sweep_summary(SUITES / name, tmp_path / "forked", fork=True)
    assert forked == fresh
    undecided = [n for n in notes if " could not show that xdist runs the plan" in n]
    assert bool(undecided) == (name in CRASH_EVERY_RUN), notes  # a run that crashed says so
    notes = [n for n in notes if n not in undecided]
    runs = [n for n in notes[1:] if "suite run" in n]  # the runs after the first: forked
    if name in REFUSED:
        assert notes[0].startswith("fork server: 0 replay(s) forked")
        assert runs == ["fork server: suite runs ran under xdist: their fork server refused "
                        "(see its note)"] or not runs  # fmt: skip
        others = [n for n in notes[1:] if n not in runs]
        assert others and all(REFUSED[name] in n for n in others)
    elif name in UNDER_XDIST:
        assert notes[0].endswith(", 0 run fresh")
        assert runs == [f"fork server: suite runs ran under xdist: {UNDER_XDIST[name]}"]
    else:  # protected reruns too: their integrations install in the child (JOB_OPTIONS)
        assert notes[0].endswith(", 0 run fresh")  # no refusal, no fallback
        assert notes[1:] == runs and all(" suite run(s) forked, " in n for n in runs)
        chosen = json.loads((SUITES / name / "answer_key.json").read_text()).get("sweep", {})
        if chosen.get("workers", 2) and chosen.get("runs", 5) > 1 and name not in CRASH_EVERY_RUN:
            assert runs, notes  # the runs after the first are forked


POLLUTED = {
    "state.py": "SEEN: list[str] = []\n",
    "test_a.py": (
        "import os, state\n"
        "def test_pollute():\n"
        "    state.SEEN.append('x')\n"
        "    os.environ['CAPSAFE_POLLUTED'] = '1'\n"
        "def test_clean():\n"
        "    assert state.SEEN == [] and 'CAPSAFE_POLLUTED' not in os.environ\n"
    ),
}


def test_the_alone_screens_watch_list_is_the_jobs_own(tmp_path: Path, forks: ForkExecutor) -> None:
    """`--capsafe-watch-env=*` (the alone screen's) is a job option: the screen's replay
    forks from the server every other alone rerun uses (on the H200 it started a second
    server, 3 s), and records a variable outside the default prefixes that the test left
    set, as a fresh process does; the plain rerun, watching the defaults, does not."""
    test = "import os\ndef test_leak():\n    os.environ['OTHER_LEAK'] = '1'\n"
    suite = write_suite(tmp_path / "suite", {"test_l.py": test, "pytest.ini": "[pytest]\n"})
    runner = make_runner(suite, tmp_path / "raw", forks)
    screen_args = ("--capsafe-watch-env=*",)
    plain = replay(runner, "alone-1", ["test_l.py::test_leak"], None)
    screen = replay(runner, "alone-2", ["test_l.py::test_leak"], None, extra=screen_args)
    assert (forks.forked, forks.fresh, len(forks._servers)) == (2, 0, 1)
    fresh = replay(make_runner(suite, tmp_path / "fresh", LocalExecutor()), "alone-1",
                   ["test_l.py::test_leak"], None, extra=screen_args)  # fmt: skip
    leaks = [[r["env_leak"] for r in p.rows if r.get("env_leak")] for p in (plain, screen, fresh)]
    assert leaks == [[], [{"OTHER_LEAK": [None, "1"]}], [{"OTHER_LEAK": [None, "1"]}]]


def test_neighbour_threads_start_in_the_child_and_the_server_still_forks(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    """Neighbours start after collection: in the server they would refuse every fork."""
    suite = SUITES / "capture"
    sequence = collected(suite)
    results = []
    for path, executor in (("fresh", LocalExecutor()), ("forked", forks)):
        runner = make_runner(suite, tmp_path / path / "raw", executor)
        replay_file = runner.raw / "replays" / "alone-1.txt"
        order.write_replay(replay_file, sequence)
        cmd = runner.pytest_command(runner.replay_targets(sequence), runner.raw / "alone-1",
                                    "alone-1", seed=5, workers=0, replay_file=replay_file,
                                    extra=("--capsafe-neighbors=1",))  # fmt: skip
        results.append(runner.run("alone-1", cmd))
        status = sorted(p.name for p in (runner.raw / "alone-1").glob("neighbors-*"))
        assert len(status) == 1, status  # the neighbours' status file, written at their stop
    fresh, forked = results
    assert (forks.forked, forks.fresh, forks.refusals) == (1, 0, {})
    assert [(r["nodeid"], r["phase"], r["outcome"]) for r in forked.rows] == [
        (r["nodeid"], r["phase"], r["outcome"]) for r in fresh.rows
    ]


def test_a_polluters_effect_does_not_leak_into_the_next_job(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    suite = write_suite(tmp_path / "suite", POLLUTED)
    runner = make_runner(suite, tmp_path / "raw", forks)
    polluted = replay(runner, "seq-1", ["test_a.py::test_pollute", "test_a.py::test_clean"], 3)
    clean = replay(runner, "alone-1", ["test_a.py::test_clean"], 3)
    assert forks.forked == 2
    assert [(r["nodeid"], r["outcome"]) for r in polluted.rows if r["phase"] == "call"] == [
        ("test_a.py::test_pollute", "passed"), ("test_a.py::test_clean", "failed")
    ]  # fmt: skip
    assert [r["outcome"] for r in clean.rows] == ["passed", "passed", "passed"]
    assert polluted.returncode == 1 and clean.returncode == 0


def test_a_prestarted_server_is_the_one_the_first_replay_forks_from(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    """The runs phase starts the replays' server (Runner.prestart_replays): the first
    replay waits for that one, and no second server is started for the same key."""
    suite = write_suite(tmp_path / "suite", POLLUTED)
    runner = make_runner(suite, tmp_path / "raw", forks)
    runner.prestart_replays()
    log = forks.workdir / "server-1" / "server.log"
    deadline = time.monotonic() + 60
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.exists()  # started before any replay asked for it
    result = replay(runner, "alone-1", ["test_a.py::test_clean"], 3)
    assert [r["outcome"] for r in result.rows] == ["passed", "passed", "passed"]
    assert (forks.forked, forks.fresh, forks.refusals) == (1, 0, {})
    assert sorted(p.name for p in forks.workdir.iterdir()) == ["server-1"]


def test_closing_while_a_prestarted_server_collects_stops_it_at_once(tmp_path: Path) -> None:
    """A sweep that ends (or is interrupted) while the prestarted server still collects
    must not wait for it, nor leave it running: it reads no stop message until it serves."""
    slow = "import time\ntime.sleep(120)\n"  # a conftest that collects for two minutes
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "conftest.py": slow})
    forks = ForkExecutor([os.curdir], tmp_path / "servers", start_timeout=300)
    runner = make_runner(suite, tmp_path / "raw", forks)
    runner.prestart_replays()
    deadline = time.monotonic() + 60
    while not forks._spawned and time.monotonic() < deadline:
        time.sleep(0.05)
    (server,) = forks._spawned
    began = time.monotonic()
    forks.close()
    assert time.monotonic() - began < 25  # not the 30 s wait for a stop it never reads
    assert server.proc.poll() is not None
    assert forks.refusals == {}  # closing is not a refusal to report


def test_a_project_that_makes_warnings_errors_passes_forked_as_fresh(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    """The server's own capture files, dropped in a child, were collected during its first
    test: the "unclosed file" ResourceWarning then failed that test wherever a project has
    `filterwarnings = error` (python-dateutil's sweep: 79 tests falsely brittle)."""
    suite = write_suite(tmp_path / "suite", {"test_w.py": "def test_one():\n    pass\n"
                                             "def test_two():\n    pass\n"})  # fmt: skip
    (suite / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    error\n")
    runner = make_runner(suite, tmp_path / "raw", forks)
    done = replay(runner, "alone-1", ["test_w.py::test_one", "test_w.py::test_two"], 3)
    assert forks.forked == 1, forks.notes()
    assert [r["outcome"] for r in done.rows if r["phase"] == "call"] == ["passed", "passed"]
    assert done.returncode == 0


CUDA_AT_IMPORT = (  # a test module whose import initialises CUDA, as far as the checks see
    "import sys, types\n"
    "torch = types.ModuleType('torch')\n"
    "torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)\n"
    "sys.modules['torch'] = torch\n"
    "def test_b():\n"
    "    pass\n"
)


@pytest.mark.parametrize("targets", [[os.curdir], ["test_a.py", "test_b.py"]],
                         ids=["directory", "files"])  # fmt: skip
def test_a_module_whose_import_initialises_cuda_is_left_out_and_the_rest_forks(
    tmp_path: Path, targets: list[str]
) -> None:
    """CuPy's test_runtime.py asks the device in a skip mark at import: one such module
    made every replay of a seven-file CuPy slice run fresh. The server finds the module,
    starts again without it (`--ignore`, or without the file where it is a target), and a
    child whose replay runs its tests collects it itself, after the fork (on the H200, the
    slice's 108 replays of such modules ran fresh, about 4 s each)."""
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "test_b.py": CUDA_AT_IMPORT})
    forks = ForkExecutor(targets, tmp_path / "servers", start_timeout=300)
    try:
        runner = make_runner(suite, tmp_path / "raw", forks)
        clean = replay(runner, "alone-1", ["test_a.py::test_clean"], 3)
        culprit = replay(runner, "alone-2", ["test_b.py::test_b"], 3)
    finally:
        forks.close()
    for done in (clean, culprit):
        assert [r["outcome"] for r in done.rows] == ["passed", "passed", "passed"]
    assert (forks.forked, forks.fresh) == (2, 0)
    assert list(forks.unforkable) == ["test_b.py"]
    assert forks.refusals == {}
    assert any("test_b.py initialises CUDA at import" in line for line in forks.notes())


def test_cuda_initialised_before_any_module_refuses_with_no_module_to_leave_out(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    """A conftest that initialises CUDA is no module's doing: every replay runs fresh."""
    conftest = CUDA_AT_IMPORT.split("def test_b")[0]
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "conftest.py": conftest})
    runner = make_runner(suite, tmp_path / "raw", forks)
    replay(runner, "alone-1", ["test_a.py::test_clean"], 3)
    assert (forks.forked, forks.fresh, forks.unforkable) == (0, 1, {})
    assert list(forks.refusals.values()) == [
        "CUDA is initialised in this process (torch.cuda.is_initialized())"
    ]


def start(suite: Path, tmp_path: Path, env: dict[str, str] | None = None) -> ForkServer:
    args = ["-p", "capsafe", "-p", "no:xdist", *QUIET, "-q", "--timeout=60"]
    return ForkServer.start(args, suite, env or dict(os.environ), tmp_path / "server", 120)


def in_turn(
    server: ForkServer, tmp_path: Path, label: str, nodeid: str, times: int, timeout: float
) -> list[int]:
    """`nodeid` as `times` jobs one after the other (`label`0, `label`1, ...) on `server`,
    closed after: their exit codes."""
    try:
        return [server.submit(job(tmp_path, f"{label}{k}", [nodeid])).wait(timeout)
                for k in range(times)]  # fmt: skip
    finally:
        server.close()


def job(tmp_path: Path, label: str, nodeids: Sequence[str]) -> Job:
    return Job(job=label, nodeids=tuple(nodeids), records=str(tmp_path / label),
               run_id=label, log=str(tmp_path / f"{label}.log"))  # fmt: skip


@pytest.mark.parametrize(
    ("conftest", "reason"),
    [
        ("import threading, time\n"
         "threading.Thread(target=time.sleep, args=(60,), name='poller', daemon=True).start()\n",
         "1 other thread(s) alive after collection: poller"),
        ("import _thread, time\n_thread.start_new_thread(time.sleep, (60,))\ntime.sleep(0.1)\n",
         "1 native thread(s) besides the main one alive after collection"),
        ("import sys, types\n"
         "torch = types.ModuleType('torch')\n"
         "torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)\n"
         "sys.modules['torch'] = torch\n",
         "CUDA is initialised in this process (torch.cuda.is_initialized())"),
        ("import os\nos.environ['CAPSAFE_BACKEND'] = 'sim'\nimport capsafe\ncapsafe.device(0)\n",
         "capsafe devices exist in this process (made at import or collection)"),
        ("import os\ndelattr(os, 'fork')\n", "this platform has no os.fork"),
    ],
    ids=["thread", "native-thread", "cuda", "capsafe-device", "no-fork"],
)  # fmt: skip
def test_an_unsafe_server_refuses_and_the_replay_runs_fresh(
    conftest: str, reason: str, tmp_path: Path, forks: ForkExecutor
) -> None:
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "conftest.py": conftest})
    with pytest.raises(Refused) as refused:
        start(suite, tmp_path).close()
    assert refused.value.reason == reason
    runner = make_runner(suite, tmp_path / "raw", forks)
    result = replay(runner, "alone-1", ["test_a.py::test_clean"], None)
    assert [r["outcome"] for r in result.rows] == ["passed", "passed", "passed"]
    assert (forks.forked, forks.fresh) == (0, 1)
    assert list(forks.refusals.values()) == [reason]
    assert any(reason in line for line in forks.notes())


def test_children_past_descriptor_1024_are_still_served(tmp_path: Path) -> None:
    """A suite that keeps over a thousand files open: each child's pidfd gets a number past
    1023, which `select` cannot wait on (the server died of ValueError at its first job)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the hard limit on open files is {hard}, under 1400")
    conftest = (
        "import os, resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))\n"
        "KEPT = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]\n"
    )
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "conftest.py": conftest})
    server = start(suite, tmp_path)
    codes = in_turn(server, tmp_path, "many", "test_a.py::test_clean", 3, 120)
    assert codes == [0, 0, 0]


def test_each_child_draws_its_own_random_numbers(tmp_path: Path) -> None:
    """Unseeded (a replay without --capsafe-seed), each fresh process draws other numbers
    from `random` and numpy's global generator; so must each child."""
    pytest.importorskip("numpy")
    test = (
        "import os, random\nfrom pathlib import Path\nimport numpy.random\n"
        "def test_draw():\n"
        "    out = Path(os.environ['CAPSAFE_SWEEP_SHARED']) / str(os.getpid())\n"
        "    out.write_text(f'{random.random()} {numpy.random.random()}')\n"
    )
    suite = write_suite(tmp_path / "suite", {"test_draw.py": test})
    shared = tmp_path / "shared"
    shared.mkdir()
    server = start(suite, tmp_path, {**os.environ, "CAPSAFE_SWEEP_SHARED": str(shared)})
    codes = in_turn(server, tmp_path, "draw", "test_draw.py::test_draw", 3, 120)
    assert codes == [0, 0, 0]
    draws = [p.read_text().split() for p in shared.iterdir()]
    assert len(draws) == 3
    for generator in range(2):  # random, then numpy
        assert len({d[generator] for d in draws}) == 3


def test_what_hypothesiss_plugin_imports_at_session_end_is_imported_once_in_the_server(
    tmp_path: Path,
) -> None:
    """hypothesis's terminal summary imports `hypothesis` in every session: in each child of
    a suite that never imports it, that import cost 1-2 s a job (most of a search)."""
    pytest.importorskip("_hypothesis_pytestplugin")
    test = (
        "import sys\n"
        "def test_imported():\n"
        "    assert 'hypothesis.internal.observability' in sys.modules\n"
    )
    suite = write_suite(tmp_path / "suite", {"test_h.py": test})
    args = ["-p", "capsafe", "-p", "no:xdist", "-p", "no:run-parallel", "-q", "--timeout=60"]
    server = ForkServer.start(args, suite, dict(os.environ), tmp_path / "server", 120)
    try:
        code = server.submit(job(tmp_path, "h1", ["test_h.py::test_imported"])).wait(120)
    finally:
        server.close()
    assert code == 0, (tmp_path / "h1.log").read_text()


@pytest.mark.cuda
def test_a_collection_that_initialises_cuda_refuses_by_the_drivers_answer(tmp_path: Path) -> None:
    """cuInit from any library (here the driver itself, through ctypes): the loaded
    libcuda answers cuDeviceGetCount with success from then on."""
    conftest = "import ctypes\nassert ctypes.CDLL('libcuda.so.1').cuInit(0) == 0\n"
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "conftest.py": conftest})
    with pytest.raises(Refused) as refused:
        start(suite, tmp_path).close()
    assert refused.value.reason.startswith("CUDA is initialised in this process (")
    assert (
        "libcuda.so" in refused.value.reason and "cuDeviceGetCount with 0" in refused.value.reason
    )


TORCH_GPU_TEST = (
    "import os\nimport torch\nassert torch.cuda.is_available()\n"
    "def test_gpu():\n"
    "    assert float(torch.ones(4, device='cuda').sum()) == 4\n"
    "    assert 'PYTORCH_NVML_BASED_CUDA_CHECK' not in os.environ\n"
)
"""A torch suite's test: the GPU works in the child, and the child's environment is the
caller's (the server's NVML switch is not in it)."""


@pytest.mark.cuda
def test_torch_asked_at_import_whether_cuda_is_available_still_forks(tmp_path: Path) -> None:
    """PyTorch suites call `torch.cuda.is_available()` at import (module-level skips); in a
    fresh process that calls cuInit, after which no child could use CUDA. The server asks
    it through NVML (SERVER_ENV), so it forks, each child uses the GPU, and a child's
    environment is the caller's again (measured on the H200: 17 of 17 torch replays ran
    fresh before)."""
    pytest.importorskip("torch")
    suite = write_suite(tmp_path / "suite", {"test_torch.py": TORCH_GPU_TEST})
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    server = start(suite, tmp_path, env)
    codes = in_turn(server, tmp_path, "t", "test_torch.py::test_gpu", 2, 300)
    assert codes == [0, 0]


@pytest.mark.cuda
def test_a_torch_child_with_neighbour_threads_uses_the_gpu(tmp_path: Path) -> None:
    """Regression (H200, torch 2.11.0+cu130, 2026-12-02): every forked child with neighbour
    threads or `--capsafe-protect=torch` crashed (SIGSEGV in torch's `_cuda_init`) when the
    neighbours' `cuInit` came before torch's own CUDA start; the crashes were read as
    failures. Torch's CUDA now starts first in such a child."""
    pytest.importorskip("torch")
    suite = write_suite(tmp_path / "suite", {"test_torch.py": TORCH_GPU_TEST})
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    server = start(suite, tmp_path, env)
    gpu_test = ["test_torch.py::test_gpu"]
    jobs = [replace(job(tmp_path, "neighbours", gpu_test), neighbors=2),
            replace(job(tmp_path, "protect", gpu_test), protect="torch")]  # fmt: skip
    try:
        codes = [server.submit(one).wait(300) for one in jobs]
    finally:
        server.close()
    assert codes == [0, 0]


FAKE_TORCH = (
    "import sys, types\n"
    "cuda = types.SimpleNamespace(started=False, is_initialized=lambda: cuda.started)\n"
    "cuda.init = lambda: setattr(cuda, 'started', True)\n"
    "sys.modules['torch'] = types.SimpleNamespace(cuda=cuda)\n"
)


def test_a_child_with_neighbours_starts_torchs_cuda_first_and_a_plain_child_does_not(
    tmp_path: Path,
) -> None:
    """The order the H200 needs (test above), on a stand-in torch: a job with neighbour
    threads finds torch's CUDA started; a job without them leaves it to the test, as a
    fresh process does."""
    test = "import sys\ndef test_started():\n    assert sys.modules['torch'].cuda.started\n"
    suite = write_suite(tmp_path / "suite", {"conftest.py": FAKE_TORCH, "test_t.py": test})
    server = start(suite, tmp_path)
    with_neighbours = replace(job(tmp_path, "neighbours", ["test_t.py::test_started"]), neighbors=1)
    plain = job(tmp_path, "plain", ["test_t.py::test_started"])
    try:
        codes = [server.submit(one).wait(120) for one in (with_neighbours, plain)]
    finally:
        server.close()
    assert codes == [0, 1]


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_a_forked_child_a_signal_ends_runs_again_fresh_and_only_that_counts(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    """The fresh process is the reference: a crash only the fork makes (the torch children
    on the H200) must not read as the test's failure."""
    suite = write_suite(tmp_path / "suite", {"test_c.py": CRASHES_WHEN_FORKED})
    runner = make_runner(suite, tmp_path / "raw", forks)
    result = replay(runner, "alone-1", ["test_c.py::test_crashes_only_forked"], seed=1)
    assert result.returncode == 0
    assert [(r["phase"], r["outcome"]) for r in result.rows] == [
        ("setup", "passed"),
        ("call", "passed"),
        ("teardown", "passed"),
    ]
    assert forks.crashed == ["alone-1"]
    assert any("ran again fresh" in line and "alone-1" in line for line in forks.notes())


def fake_proc(tmp_path: Path, maps: str, devices: Sequence[str]) -> Path:
    """A /proc/self stand-in: `maps`, and descriptors linked to `devices`."""
    proc = tmp_path / "proc"
    (proc / "fd").mkdir(parents=True)
    (proc / "maps").write_text(maps)
    for fd, device in enumerate(devices, start=3):
        (proc / "fd" / str(fd)).symlink_to(device)
    return proc


def test_nvidia_devices_open_without_a_loaded_driver_are_nvmls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML (torch's fork-safe availability check) opens /dev/nvidia* without libcuda: a
    child forked after it uses CUDA as a fresh process does (measured on the H200)."""
    proc = fake_proc(tmp_path, "7f00-7f01 r-xp 0 0:0 0 /usr/lib/libnvidia-ml.so.1\n",
                     ["/dev/nvidiactl", "/dev/nvidia-uvm"])  # fmt: skip
    monkeypatch.setattr(fork_checks, "PROC_SELF", proc)
    assert fork_checks._initialised_driver() is None  # the driver's part of cuda_in_use


def test_a_driver_that_cannot_be_asked_leaves_the_open_device_to_decide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libcuda in the maps but not loadable here (RTLD_NOLOAD finds nothing): conservative."""
    maps = "7f00-7f01 r-xp 0 0:0 0 /nonexistent/libcuda.so.1\n"
    monkeypatch.setattr(fork_checks, "PROC_SELF", fake_proc(tmp_path, maps, ["/dev/nvidiactl"]))
    assert (
        fork_checks.cuda_in_use() == "CUDA is initialised in this process (/dev/nvidiactl is open)"
    )
    monkeypatch.setattr(fork_checks, "PROC_SELF", fake_proc(tmp_path / "b", maps, []))
    assert fork_checks._initialised_driver() is None  # capsafe's own state is another part


def fake_tasks(proc: Path, names: Sequence[str]) -> None:
    for tid, name in enumerate(names, start=100):
        (proc / "task" / str(tid)).mkdir(parents=True)
        (proc / "task" / str(tid) / "comm").write_text(name + "\n")


def test_nvmls_thread_is_allowed_and_any_other_native_thread_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's NVML-based availability check leaves one native thread, named like the
    driver's (cuda00001800007 on the H200): allowed; an unknown native thread is not."""
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.current_thread()])
    proc = fake_proc(tmp_path, "", [])
    fake_tasks(proc, ["python3", "cuda00001800007"])
    monkeypatch.setattr(fork_checks, "PROC_SELF", proc)
    assert fork_checks.other_threads() is None
    (proc / "task" / "200").mkdir()
    (proc / "task" / "200" / "comm").write_text("python3\n")
    assert fork_checks.other_threads() == (
        "1 native thread(s) besides the main one alive after collection"
    )


def test_without_maps_to_read_the_check_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fork_checks, "PROC_SELF", tmp_path / "missing")
    assert fork_checks.cuda_in_use() == (
        "CUDA may be initialised in this process (no /proc/self/maps to look at)"
    )


@pytest.mark.cuda
def test_a_forked_child_initialises_cuda_itself(tmp_path: Path) -> None:
    """No CUDA in the server: each child makes its own context, as a fresh process does."""
    test = (
        "import os\nos.environ['CAPSAFE_BACKEND'] = 'cuda'\nimport capsafe\n"
        "def test_device():\n    assert capsafe.device(0).name\n"
    )
    suite = write_suite(tmp_path / "suite", {"test_gpu.py": test})
    server = start(suite, tmp_path)
    codes = in_turn(server, tmp_path, "gpu", "test_gpu.py::test_device", 2, 300)
    assert codes == [0, 0]


def test_openblas_workers_started_by_numpy_do_not_refuse_a_fork(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    pytest.importorskip("numpy")
    conftest = "import numpy\nnumpy.ones((64, 64)) @ numpy.ones((64, 64))\n"
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "conftest.py": conftest})
    runner = make_runner(suite, tmp_path / "raw", forks)
    result = replay(runner, "alone-1", ["test_a.py::test_clean"], None)
    assert [r["outcome"] for r in result.rows] == ["passed", "passed", "passed"]
    assert (forks.forked, forks.fresh, forks.refusals) == (1, 0, {})


LATE_THREAD = (
    "import signal, threading, time\n"
    "def late(signum, frame):\n"
    "    threading.Thread(target=time.sleep, args=(60,), name='late', daemon=True).start()\n"
    "signal.signal(signal.SIGUSR1, late)\n"
)


def test_a_job_the_server_declines_runs_as_a_fresh_process(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    """The checks run again before every fork: a thread the server started after it said
    ready (here from a signal handler) declines the next job, which runs fresh."""
    suite = write_suite(tmp_path / "suite", {**POLLUTED, "conftest.py": LATE_THREAD})
    runner = make_runner(suite, tmp_path / "raw", forks)
    first = replay(runner, "alone-1", ["test_a.py::test_clean"], None)
    (server,) = (s for s in forks._servers.values() if s is not None)
    os.kill(server.proc.pid, signal.SIGUSR1)
    tasks, end = Path(f"/proc/{server.proc.pid}/task"), time.monotonic() + 60
    while len(os.listdir(tasks)) < 2:  # the handler has run (between two polls of the loop)
        assert time.monotonic() < end, "the server never started its late thread"
        time.sleep(0.01)
    second = replay(runner, "alone-2", ["test_a.py::test_clean"], None)
    assert [r["outcome"] for r in first.rows + second.rows] == ["passed"] * 6
    assert first.rows[0]["pid"] != second.rows[0]["pid"]
    assert (forks.forked, forks.fresh) == (1, 1)
    assert "1 other thread(s) alive after collection: late" in forks.refusals.values()


def test_a_server_that_died_between_jobs_runs_the_rest_fresh_and_says_why(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    """A dead server is not started again: every later replay (and suite run) runs fresh,
    and the report says why (before 2026-12-03 it gave no reason)."""
    suite = write_suite(tmp_path / "suite", POLLUTED)
    runner = make_runner(suite, tmp_path / "raw", forks)
    first = replay(runner, "alone-1", ["test_a.py::test_clean"], None)
    (server,) = (s for s in forks._servers.values() if s is not None)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    second = replay(runner, "alone-2", ["test_a.py::test_clean"], None)
    assert [r["outcome"] for r in first.rows + second.rows] == ["passed"] * 6
    assert (forks.forked, forks.fresh) == (1, 1)
    (why,) = forks.refusals.values()
    assert why == f"it died (exit -9; see {server.log})"


def test_the_checks_name_a_live_thread_and_pass_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread check alone: capsafe devices another test of this worker made would
    answer cuda_in_use() first (fork_refusal asks it before the threads), and an xdist
    worker's own native threads are in its task list (so the native count is faked)."""
    proc = fake_proc(tmp_path, "", [])
    fake_tasks(proc, ["python3"])
    monkeypatch.setattr(fork_checks, "PROC_SELF", proc)
    assert fork_checks.other_threads() is None
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="holder")
    thread.start()
    try:
        assert fork_checks.other_threads() == "1 other thread(s) alive after collection: holder"
    finally:
        stop.set()
        thread.join()


DYING = {
    "test_d.py": (
        "import os, time\n"
        "def test_first(): pass\n"
        "def test_exits(): os._exit(3)\n"
        "def test_hangs(): time.sleep(600)\n"
        "def test_after(): pass\n"
    ),
}


def test_a_child_that_calls_os_exit_ends_as_a_fresh_process_would(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    suite = write_suite(tmp_path / "suite", DYING)
    sequence = ["test_d.py::test_first", "test_d.py::test_exits", "test_d.py::test_after"]
    results = [
        replay(make_runner(suite, tmp_path / path / "raw", executor), "alone-1", sequence, 1)
        for path, executor in (("fresh", LocalExecutor()), ("forked", forks))
    ]
    fresh, forked = results
    assert forks.forked == 1
    assert forked.returncode == fresh.returncode == 3
    assert comparable(forked.rows) == comparable(fresh.rows)
    assert forked.rows[-1]["nodeid"] == "test_d.py::test_exits"  # its setup: the last row
    died_in = [[k.nodeid for k in r.end.killed] for r in (fresh, forked)]
    assert died_in == [["test_d.py::test_exits"]] * 2  # the sweep's crash, as for a fresh one


def test_a_hung_child_is_killed_by_the_watchdog_with_its_rows_kept(
    tmp_path: Path, forks: ForkExecutor
) -> None:
    suite = write_suite(tmp_path / "suite", DYING)
    options = SweepOptions(paths=(suite,), out=tmp_path, seed=1, timeout=600, stall_s=3,
                           invoked_from=suite, pytest_args=QUIET, progress=False)  # fmt: skip
    runner = Runner(options, tmp_path / "raw", executor=forks)
    runner.rootdir, runner.inifile = suite, str(suite / "pytest.ini")
    result = replay(runner, "alone-1", ["test_d.py::test_first", "test_d.py::test_hangs"], 1)
    assert forks.forked == 1
    assert result.stalled and result.returncode == -signal.SIGKILL
    assert result.killed_in == ("test_d.py::test_hangs",)
    assert [(r["nodeid"], r["phase"], r["outcome"]) for r in result.rows][:3] == [
        ("test_d.py::test_first", p, "passed") for p in ("setup", "call", "teardown")
    ]


def test_killing_one_of_two_concurrent_jobs_leaves_the_other_running(tmp_path: Path) -> None:
    suite = write_suite(tmp_path / "suite", DYING)
    server = start(suite, tmp_path)
    try:
        hung = server.submit(job(tmp_path, "hung", ["test_d.py::test_hangs"]))
        fine = server.submit(job(tmp_path, "fine", ["test_d.py::test_first"]))
        assert fine.wait(120) == 0
        assert hung.returncode is None  # still asleep beside the other

        def setup() -> list[str]:
            rows = load_records(tmp_path / "hung")[0]
            return [r["outcome"] for r in rows if r["phase"] == "setup"]

        # On a loaded machine the other child may finish before this one reaches its test
        # (the clean CI's 8 workers on 2 cores): it is killed asleep in it, not before.
        deadline = time.monotonic() + 120
        while not setup() and time.monotonic() < deadline:
            time.sleep(0.05)
        hung.kill()
        assert hung.wait(120) == -signal.SIGKILL
        assert setup() == ["passed"]
    finally:
        server.close()


OVERLAP = {
    "test_pair.py": (
        "import os, time\n"
        "from pathlib import Path\n"
        "def meet(me, other):\n"
        "    shared = Path(os.environ['CAPSAFE_SWEEP_SHARED'])\n"
        "    (shared / me).touch()\n"
        "    end = time.monotonic() + 60\n"
        "    while not (shared / other).exists():\n"
        "        assert time.monotonic() < end, 'the other job never ran beside this one'\n"
        "        time.sleep(0.01)\n"
        "def test_left(): meet('left', 'right')\n"
        "def test_right(): meet('right', 'left')\n"
    ),
}


def test_two_jobs_run_concurrently_as_a_pair_run_needs(tmp_path: Path) -> None:
    suite = write_suite(tmp_path / "suite", OVERLAP)
    shared = tmp_path / "shared"
    shared.mkdir()
    server = start(suite, tmp_path, {**os.environ, "CAPSAFE_SWEEP_SHARED": str(shared)})
    try:
        left = server.submit(job(tmp_path, "left", ["test_pair.py::test_left"]))
        right = server.submit(job(tmp_path, "right", ["test_pair.py::test_right"]))
        assert (left.wait(120), right.wait(120)) == (0, 0)
        assert left.pid != right.pid
    finally:
        server.close()


CHATTY = {
    "test_say.py": (
        "import time\n"
        "def say(me):\n"
        "    for _ in range(50):\n"
        "        print(f'<{me}>', flush=True)\n"
        "        time.sleep(0.01)\n"
        "    assert False, me\n"
        "def test_one(): say('one')\n"
        "def test_two(): say('two')\n"
    ),
}


def test_concurrent_jobs_capture_their_own_output(tmp_path: Path) -> None:
    """pytest's capture files are opened in the server: each child must have its own, or
    one child's read-and-truncate eats what the other captured."""
    suite = write_suite(tmp_path / "suite", CHATTY)
    server = start(suite, tmp_path)
    try:
        handles = {me: server.submit(job(tmp_path, me, [f"test_say.py::test_{me}"]))
                   for me in ("one", "two")}  # fmt: skip
        assert [h.wait(120) for h in handles.values()] == [1, 1]
    finally:
        server.close()
    for me, other in (("one", "two"), ("two", "one")):
        log = (tmp_path / f"{me}.log").read_text()  # the failure's "Captured stdout call"
        assert log.count(f"<{me}>") == 50
        assert f"<{other}>" not in log


def test_a_job_naming_an_uncollected_test_is_a_usage_error_as_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    suite = write_suite(tmp_path / "suite", POLLUTED)
    server = start(suite, tmp_path)
    try:
        missing = server.submit(job(tmp_path, "missing", ["test_a.py::test_gone"]))
        assert missing.wait(120) == pytest.ExitCode.USAGE_ERROR
        log = (tmp_path / "missing.log").read_text()
        assert "1 listed test(s) were not collected: test_a.py::test_gone" in log
    finally:
        server.close()


def test_a_dead_server_ends_its_jobs_as_lost_and_kills_their_children(tmp_path: Path) -> None:
    suite = write_suite(tmp_path / "suite", DYING)
    server = start(suite, tmp_path)
    hung = server.submit(job(tmp_path, "hung", ["test_d.py::test_hangs"]))
    os.kill(server.proc.pid, signal.SIGKILL)
    assert hung.wait(120) == -signal.SIGKILL
    assert hung.lost.startswith("the fork server died")
    end = time.monotonic() + 60
    while _alive(hung.pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(hung.pid)
    server.close()
    with pytest.raises(Refused):
        server.submit(job(tmp_path, "late", ["test_d.py::test_first"]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_only_single_process_replays_are_split_for_a_server() -> None:
    base = [sys.executable, "-m", "pytest", "test_a.py", "-p", "capsafe", "--rootdir=/s"]
    job_args = ["--capsafe-records=/r/x", "--capsafe-run-id=x", "--capsafe-replay=/r/x.txt"]
    split = split_replay([*base, *job_args, "--capsafe-seed=4", "-p", "no:xdist", "-q"])
    assert split is not None
    assert split.server_args == ("-p", "capsafe", "--rootdir=/s", "-p", "no:xdist", "-q")
    assert (split.records, split.run_id, split.replay_file, split.seed) == (
        "/r/x", "x", "/r/x.txt", 4
    )  # fmt: skip
    neighbors = ["--capsafe-neighbors=2", "-p", "no:xdist", "--capsafe-neighbors=0"]
    split = split_replay([*base, *job_args, *neighbors, "--capsafe-neighbor-calls=ctx_sync"])
    assert split is not None and split.server_args == ("-p", "capsafe", "--rootdir=/s",
                                                       "-p", "no:xdist")  # fmt: skip
    assert (split.neighbors, split.neighbor_calls) == (0, "ctx_sync")  # the last one wins
    in_process = split_replay([*base, *job_args, "-n=0"])  # xdist loaded, as in the runs
    assert in_process is not None and in_process.server_args[-1] == "-n=0"
    assert split_replay([*base, *job_args, "-n=2"]) is None  # xdist workers: a suite run
    assert split_replay([*base, *job_args[:2], "-p", "no:xdist"]) is None  # not a replay


def test_a_sweep_run_inside_pytest_gives_its_processes_none_of_that_pytests_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inherited PYTEST_XDIST_WORKER made pytest-benchmark warn "xdist active" in every
    fork server of our own suite's sweeps, an error under `filterwarnings = error`."""
    for name in OUTER_PYTEST_VARIABLES:
        monkeypatch.setenv(name, "gw9")
    monkeypatch.setenv("PYTEST_ADDOPTS", "-v")  # the user's own settings pass
    found = inherited_environ()
    assert not set(OUTER_PYTEST_VARIABLES) & set(found)
    assert found["PYTEST_ADDOPTS"] == "-v"


@pytest.mark.parametrize(
    "answer",
    [b"not json\n", b'{"event": "ready", "collected": "many"}\n', b'{"no event": 1}\n'],
)
def test_an_answer_the_sweep_cannot_read_ends_the_server_and_refuses(
    tmp_path: Path, answer: bytes
) -> None:
    """A reader thread that died on an answer left "ready" unset: the sweep waited out the
    whole start timeout (pytest 9.2's `maxfail` of None, in the landing CI)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)  # fmt: skip
    jobs_read, jobs_write = os.pipe()
    results_read, results_write = os.pipe()
    server = ForkServer(proc, jobs_write, results_read, tmp_path / "server.log")
    server._reader.start()
    os.write(results_write, answer)
    started = time.monotonic()
    with pytest.raises(Refused, match="the fork server's answer could not be read"):
        server.wait_ready(timeout=60)
    assert time.monotonic() - started < 30  # told, not timed out
    assert proc.wait(timeout=30) == -signal.SIGKILL
    os.close(results_write)
    os.close(jobs_read)
