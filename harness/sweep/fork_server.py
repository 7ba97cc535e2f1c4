"""The fork server process: pytest started and collected once, one forked child per job.

`python -m capsafe_harness.sweep.fork_server PYTEST_ARGS...` runs pytest with the
arguments a fresh replay process would get (its per-job options left out: records,
run id, replay list, seed), so plugins, conftests and test modules load and the suite
is collected once. In place of running the tests, `pytest_runtestloop` serves jobs
read from a pipe (fork_client holds the other end): for each it checks that a fork
is safe (fork_checks), forks, and reports the child's pid, later its exit status.

The child becomes what a fresh `pytest --capsafe-replay` process is after its
collection: a session of its own (the caller's watchdog kills its process group), the
job's variables set in the environment, stdout and stderr into the job's log, capture
files of its own, the capsafe plugin registered anew with the job's records directory,
run id, seed and neighbour threads (so its records, marks and exit status are written
as in a fresh process, by the same code), the replay order applied by the plugin's own
hook, and then pytest's normal run loop, fixture setup and teardown, session finish
and exit status. Module state is the state right after collection, copied on write: a
test that changes it in one child leaves the next child's copy as it was.

What differs from a fresh process (docs/harness.md, "The fork server"):
import-time side effects of the suite happen once, in the server, before any job (but for
a module whose import initialises CUDA: the server leaves it out, and a child that runs its
tests collects it itself)
(a file a module creates on import is shared by all jobs); the server collects every
path of the suite where a fresh replay collects only the files of its tests; every
child shares the server's hash seed (PYTHONHASHSEED); the child runs the atexit
handlers registered after the fork only (those of import time stay the server's); the
objects alive after collection are frozen (`gc.freeze`, after one collection in the
server), so a child's garbage collections skip them: pytest collects five times at
session end, which in a child would otherwise walk, and so copy, the whole heap; a module
a plugin imports at every session's end (hypothesis's) is imported in the server, so a
test in a child finds it imported where a fresh process imports it after the last test;
so are the seeders registered for pytest-randomly's entry point group, which a fresh
process loads in its first test's setup (the entry point scan alone took that setup from
0.2 to 15-50 ms);
during import and collection the server has PYTORCH_NVML_BASED_CUDA_CHECK=1 (unless the
caller set it), so torch answers `is_available()` at import without `cuInit`, which
would leave nothing to fork (SERVER_ENV; the child's environment is the caller's again);
a child with neighbour threads or integrations, of a server that imported torch, starts
torch's CUDA before them, where a fresh process leaves it to the test (_torch_cuda_first).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import inspect
import json
import os
import select
import signal
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from ..plugin import (
    PLUGIN_NAME,
    CapsafeRun,
    _resolve,
    captures,
    neighbor_run,
    phase_times,
    protect,
    seeding,
)
from . import worker_reads
from .fork_checks import cuda_in_use, fork_refusal

__all__ = ["FDS_ENV", "JOB_OPTIONS", "MODULE", "Job", "main"]

MODULE = "capsafe_harness.sweep.fork_server"
FDS_ENV = "CAPSAFE_FORK_SERVER_FDS"
"""'JOBS,RESULTS': the pipe descriptors the server reads jobs from and answers on."""
JOB_OPTIONS = (
    "--capsafe-records",
    "--capsafe-run-id",
    "--capsafe-replay",
    "--capsafe-seed",
    "--capsafe-neighbors",
    "--capsafe-neighbor-calls",
    "--capsafe-watch-env",
    protect.OPTION,
)
"""The options a job sets for itself; the server's command line carries none of them.
Neighbour threads are the job's: they start after collection, so in the server they would
be alive at every fork (and would have initialised CUDA there). The variables a job
watches (the alone screen's `*`) are its own, so one server serves every alone rerun. So
are the integrations of
`--capsafe-protect`: installing one makes capsafe's driver (`cuInit` on a GPU), so a
child installs its own at its session start, after collection where a fresh process
installs them before; a name a test module bound at import (`from torch.cuda import
synchronize`) then keeps the framework's original, so a forked protected run gates
no more than a fresh one does (docs/harness.md)."""
SERVER_RUN_ID = "fork-server"
SERVER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""Set in the server only (a child gets the environment a fresh process has): torch's
`cuda.is_available()`, which suites call at import (skip marks), then asks NVML instead of
calling `cuInit`, which no process may fork after. The answer is the same."""
POLL_S = 0.02
"""How often the job loop looks for ended children where it cannot be woken by their exit
(no `os.pidfd_open`: not Linux); with it a child's exit is answered at once (at 20 ms a
poll, each job's end waited 10 ms on average: 1.4 s over a 2,000-test synthetic sweep's
140 jobs, much of it on searches that run one replay after another)."""
SESSION_END_IMPORTS = {"hypothesispytest": "hypothesis.internal.observability"}
"""Plugin name -> the module it imports in every session's terminal summary."""
JOB_PLUGINS = (PLUGIN_NAME, phase_times.PLUGIN_NAME, neighbor_run.PLUGIN_NAME, protect.PLUGIN_NAME)
"""The capsafe plugins that hold per-process state (records file, marks, neighbours):
replaced in each child by ones made for its job."""


@dataclass(frozen=True)
class Job:
    """One replay: these tests in this order, into this records directory and log."""

    job: str  # the caller's id for it
    nodeids: tuple[str, ...]
    records: str
    run_id: str
    log: str
    seed: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # set on top of the server's environment
    replay_file: str | None = None  # shown in the plugin's header only
    neighbors: int = 0  # --capsafe-neighbors: threads started in the child after collection
    neighbor_calls: str | None = None  # --capsafe-neighbor-calls
    protect: str | None = None  # --capsafe-protect: integrations installed in the child
    watch_env: str | None = None  # --capsafe-watch-env (None: the server's, the default)
    argv: tuple[str, ...] = ()  # sys.argv[1:] of the fresh process it stands for
    collect: tuple[str, ...] = ()  # modules the server left out: the child collects them
    # A share of a suite run: the xdist worker the child stands for ("gw1"), how many the
    # run has, and the run's test run uid (xdist's `worker_id`, `testrun_uid` fixtures).
    worker: str = ""
    workers: int = 0
    testrun_uid: str = ""

    def to_json(self) -> str:
        return json.dumps({"op": "run", **self.__dict__, "nodeids": list(self.nodeids),
                           "argv": list(self.argv), "collect": list(self.collect)})  # fmt: skip

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> Job:
        fields = {k: v for k, v in message.items() if k != "op"}
        return cls(**{**fields, "nodeids": tuple(fields["nodeids"]),
                      "argv": tuple(fields.get("argv", ())),
                      "collect": tuple(fields.get("collect", ()))})  # fmt: skip


class Server:
    """The pytest plugin that turns the run loop into the job loop (see the module doc)."""

    def __init__(self, jobs: int, results: int, added_env: Sequence[str] = ()) -> None:
        self.jobs, self.results = jobs, results
        self.added_env = tuple(added_env)  # SERVER_ENV names the server set: a child drops them
        self.pid = os.getpid()
        self.job: Job | None = None  # set in a child: the job it runs
        self.answered = False  # said "ready" or "refused"
        self._children: dict[str, int] = {}  # job id -> child pid
        self._exits: dict[str, int] = {}  # job id -> a pidfd readable once the child ended
        self._poll = select.poll()  # the jobs pipe and the pidfds (poll: select stops at
        self._poll.register(jobs, select.POLLIN)  # descriptor 1024, which a suite can pass)
        self._pending = b""
        # The first test module whose import initialised CUDA (node id, path), and whether
        # CUDA was found in use before any module's collection began (a conftest, a plugin).
        self.culprit: tuple[str, str] | None = None
        self._cuda_before_modules = False

    @property
    def in_child(self) -> bool:
        return os.getpid() != self.pid

    def send(self, **message: Any) -> None:
        data = memoryview((json.dumps(message) + "\n").encode("utf-8"))
        with contextlib.suppress(BrokenPipeError):  # the client is gone: it stops us anyway
            while data:  # "ready" carries the collection: more than one pipe buffer
                data = data[os.write(self.results, data) :]

    def pytest_collectstart(self, collector: pytest.Collector) -> None:
        if isinstance(collector, pytest.Module) and self._watching() and cuda_in_use():
            self._cuda_before_modules = True  # not a module's import: nothing to leave out

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Any:
        report = yield
        if isinstance(collector, pytest.Module) and self._watching() and cuda_in_use():
            self.culprit = (collector.nodeid, str(collector.path))
        return report

    def _watching(self) -> bool:
        """Still looking for the module whose import initialises CUDA (CuPy's test_runtime.py
        asks `deviceGetAttribute` in a skip mark): the server can serve without it."""
        return self.culprit is None and not self._cuda_before_modules and not self.in_child

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool | None:
        if session.config.option.collectonly:
            return None
        worker_reads.stop()
        # What each child would do first, done once here, before the check below: an
        # import that starts a thread or initialises CUDA refuses the server up front.
        _import_session_end_modules(session.config)
        captures.preload()
        _map_source_files()
        reason = fork_refusal()
        if reason is not None:
            print(f"capsafe fork server: refused: {reason}", file=sys.stderr)  # in its log
            module, path = self.culprit or ("", "")
            self.send(event="refused", reason=reason, module=module, path=path)
            self.answered = True
            return True
        seeding.registered_seeders()  # read here once, not by every child's first test
        gc.collect()  # the garbage of start-up and collection, once, here
        gc.freeze()  # the rest is permanent: no child's collection walks (and copies) it
        config = session.config
        run = config.pluginmanager.get_plugin(PLUGIN_NAME)
        self.send(event="ready", collected=len(session.items),
                  received=list(getattr(run, "received", ())),
                  items=[item.nodeid for item in session.items],
                  errors=session.testsfailed, dist=getattr(config.option, "dist", "no"),
                  maxfail=config.option.maxfail or 0,  # None in pytest 9.2 when not given
                  worker_reads=worker_reads.suite_reads(config.rootpath))  # fmt: skip
        self.answered = True
        job = self._serve()
        if job is None:
            return True  # the server's own session ends: no test ran in it
        for name in self.added_env:
            os.environ.pop(name, None)
        _become(session, job)
        return None  # pytest's own run loop runs the job's items, here in the child

    # -- the job loop (server) ------------------------------------------------
    def _serve(self) -> Job | None:
        """Serve until told to stop (None) or, in a forked child, return its job."""
        stopping = False
        while not (stopping and not self._children):
            self._reap()
            events = self._poll.poll(POLL_S * 1000)
            if not any(fd == self.jobs for fd, _ in events):
                continue
            data = os.read(self.jobs, 1 << 16)
            if not data:  # the client died: nobody reads our children's results
                self._kill_children()
                stopping = True
                continue
            self._pending += data
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = json.loads(line)
                if message["op"] == "stop":
                    stopping = True
                elif message["op"] == "kill":
                    self._kill(message["job"])
                elif message["op"] == "run":
                    job = Job.from_message(message)
                    if self._fork(job):
                        return job
        return None

    def _fork(self, job: Job) -> bool:
        """Fork a child for `job`; True in the child."""
        reason = fork_refusal()
        if reason is not None:
            self.send(event="declined", job=job.job, reason=reason)
            return False
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing buffered is written twice
        pid = os.fork()
        if pid == 0:
            os.setsid()  # its own process group: the caller's kill ends what it started too
            os.close(self.jobs)
            os.close(self.results)
            for fd in self._exits.values():
                os.close(fd)
            self._children.clear()
            self._exits.clear()
            return True
        self._children[job.job] = pid
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):  # a kernel before 5.3: polled instead
                self._exits[job.job] = os.pidfd_open(pid)
                self._poll.register(self._exits[job.job], select.POLLIN)
        self.send(event="started", job=job.job, pid=pid)
        return False

    def _reap(self) -> None:
        for job, pid in list(self._children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self._children[job]
                if job in self._exits:
                    exited = self._exits.pop(job)
                    self._poll.unregister(exited)
                    os.close(exited)
                self.send(event="exit", job=job, returncode=os.waitstatus_to_exitcode(status))

    def _kill(self, job: str) -> None:
        pid = self._children.get(job)
        if pid is not None:  # not reaped yet, so the pid is still this child's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _kill_children(self) -> None:
        for job in list(self._children):
            self._kill(job)


def _become(session: pytest.Session, job: Job) -> None:
    """Turn this forked child into a fresh replay process for `job`, right after collection."""
    atexit._clear()  # the server's handlers (import time) run once, in the server
    os.environ.update(job.env)  # on what the suite's imports left (a conftest's setdefault)
    if job.argv:  # what a test reading sys.argv would see in the fresh process
        sys.argv[1:] = job.argv
    _reseed_numpy()
    _redirect_output(job.log)
    config = session.config
    _own_capture(config)
    session.testsfailed = 0  # collection errors of files a fresh replay would not collect
    session.shouldstop = session.shouldfail = False
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.stats.pop("error", None)
        if hasattr(reporter, "_session_start"):  # "in 0.12s" counts from the fork
            reporter._session_start = type(reporter._session_start)()
    manager = config.pluginmanager
    for name in JOB_PLUGINS:
        if manager.get_plugin(name) is not None:
            manager.unregister(name=name)
    if job.collect:
        _collect_left_out(session, job.collect)
    if not job.worker:
        _narrow_to(session, job.nodeids)
    option = config.option
    option.capsafe_records, option.capsafe_run_id = job.records, job.run_id
    option.capsafe_seed = None if job.seed is None else str(job.seed)
    option.capsafe_replay = None
    option.capsafe_neighbors, option.capsafe_neighbor_calls = job.neighbors, job.neighbor_calls
    option.capsafe_protect = job.protect
    if job.watch_env is not None:
        option.capsafe_watch_env = job.watch_env
    if job.worker:
        _as_xdist_worker(config, job)
    settings = replace(
        _resolve(config), replay=job.nodeids, replay_file=job.replay_file, shuffle="none"
    )
    if job.neighbors or job.protect:
        _torch_cuda_first()
    before = set(manager.get_plugins())
    protect.configure(config)  # installs at the session start called below
    manager.register(CapsafeRun(config, settings), PLUGIN_NAME)
    others = [p for p in manager.get_plugins() if p in before]
    # What a fresh process's new plugins would have seen before its run loop.
    manager.subset_hook_caller("pytest_sessionstart", others)(session=session)
    manager.subset_hook_caller("pytest_collection_modifyitems", others)(
        session=session, config=config, items=session.items
    )
    manager.subset_hook_caller("pytest_collection_finish", others)(session=session)


def _as_xdist_worker(config: pytest.Config, job: Job) -> None:
    """Make this child the xdist worker it stands in for, as xdist's fixtures, its variables
    and the capsafe plugin tell it: `config.workerinput` (`worker_id` and `testrun_uid` read
    it, the plugin its worker id, seed and run id) and the variables an xdist worker sets.
    What read them before the fork (import, collection, configure) saw the server's none:
    a suite whose own code did keeps its runs under xdist (worker_reads)."""
    config.workerinput = {  # type: ignore[attr-defined]
        "mainargv": list(sys.argv),
        "workerid": job.worker,
        "workercount": job.workers,
        "testrunuid": job.testrun_uid,
        "capsafe_seed": job.seed,
        "capsafe_run_id": job.run_id,
    }
    config.workeroutput = {}  # type: ignore[attr-defined]
    os.environ.update({worker_reads.WORKER: job.worker, worker_reads.COUNT: str(job.workers),
                       worker_reads.RUN_UID: job.testrun_uid})  # fmt: skip


def _torch_cuda_first() -> None:
    """In a child of a server that imported torch, torch's CUDA starts before capsafe's
    neighbour threads or integrations touch the driver. Measured on the H200 (torch
    2.11.0+cu130, driver 580.159.04, 2026-12-02, docs/harness.md "The fork server"): in a
    child forked from a process that imported torch, torch's own CUDA initialisation
    crashed the child (SIGSEGV in `torch._C._cuda_init`) when `cuInit` had come first from
    another thread (the neighbours) or without a current context; with torch's first, both
    ran. A fresh process has no such order. Without a device (or CUDA) the test meets
    torch's error itself, as in a fresh process."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is None or cuda.is_initialized():
        return
    with contextlib.suppress(Exception):
        cuda.init()


def _collect_left_out(session: pytest.Session, paths: Sequence[str]) -> None:
    """Collect, here in the child, the modules the server left out because importing them
    initialises CUDA (CuPy's test_memory.py asks the driver's version in its skip marks):
    the child is a process of its own, so CUDA may start in it. Their items join the
    server's; a file given as an argument is collected whatever `--ignore` says."""
    served = list(session.items)
    session.perform_collect(list(paths))
    session.items = [*served, *session.items]
    session.testscollected = len(session.items)


def _map_source_files() -> None:
    """Build, once here, the map from source file to module that `inspect.getmodule` makes
    over every loaded module the first time it is asked about a code object: pytest asks
    it when it formats a failure's source, so each child's first failing test paid for the
    whole map (15 of the 23 ms that failure took, at 2,000 tests: every search replay that
    reproduces, every screen's sentinel). Later imports are mapped as they are asked."""
    inspect.getmodule(_map_source_files.__code__)


def _narrow_to(session: pytest.Session, nodeids: Sequence[str]) -> None:
    """Keep of the server's collection only the replay's tests, in collection order, before
    the plugins' collection hooks run again here: a fresh replay collects only its tests'
    modules, and handing every plugin the whole suite cost each child 5 ms at 2,000 tests
    (the capsafe plugin's replay selection, the deselection of the rest). A suite run's
    share keeps the whole collection, as an xdist worker has it."""
    wanted = set(nodeids)
    session.items = [item for item in session.items if item.nodeid in wanted]


def _import_session_end_modules(config: pytest.Config) -> None:
    """Import here, once, what a loaded plugin imports at every session's end: in each
    child it cost that child the import (hypothesis's terminal summary imports
    `hypothesis`: 1-2 s a job, most of a search's time on a suite that never imports it)."""
    for plugin, module in SESSION_END_IMPORTS.items():
        if config.pluginmanager.has_plugin(plugin):
            with contextlib.suppress(ImportError):
                importlib.import_module(module)


def _reseed_numpy() -> None:
    """numpy's global generator from fresh entropy, as numpy seeds it on import in a fresh
    process (Python's `random` reseeds itself in a forked child). Without it every child
    would draw the server's numbers: an unseeded random test would fail in all or none."""
    numpy_random = sys.modules.get("numpy.random")
    seed = getattr(numpy_random, "seed", None)
    if callable(seed):
        seed()


_SERVERS_CAPTURE: list[object] = []
"""The server's capture objects, held in a child until it exits (see `_own_capture`)."""


def _own_capture(config: pytest.Config) -> None:
    """Give this child capture files of its own. pytest's global capture (what tests and
    their fixtures print, reported with a failure) goes to temporary files opened once, in
    the server, so every child would share them, and a child's read-and-truncate would eat
    what a concurrent sibling captured. The old ones are dropped unread (reading would
    truncate the shared file), and new ones started and suspended, as between tests."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    if capture is None or getattr(capture, "_global_capturing", None) is None:
        return  # -s / --capture=no: nothing shared
    # Kept, not closed (closing would put the server's descriptors back) nor left to the
    # garbage collector: its "unclosed file" ResourceWarning failed the first test of every
    # child in a project with `filterwarnings = error` (python-dateutil's: 79 false brittles).
    _SERVERS_CAPTURE.append(capture._global_capturing)
    capture._global_capturing = None
    capture.start_global_capturing()
    capture.suspend_global_capture()


def _redirect_output(log: str) -> None:
    """Point every descriptor open on the server's stdout or stderr (1, 2, and the copies
    pytest's capture and faulthandler keep) at the job's log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    targets = {1, 2}
    served = {_identity(1), _identity(2)} - {None}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            other = int(name)
            if other > 2 and other != fd and _identity(other) in served:
                targets.add(other)
    for target in targets:
        os.dup2(fd, target)
    os.close(fd)


def _identity(fd: int) -> tuple[int, int] | None:
    """(device, inode) of a regular file open on `fd`; None for anything else."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def server_args(records: Path, args: Sequence[str]) -> list[str]:
    """The server's pytest arguments: a fresh replay's, with the capsafe plugin active
    (configured as in a fresh process) but recording into a directory of its own."""
    return [*args, f"--capsafe-records={records}", f"--capsafe-run-id={SERVER_RUN_ID}"]


def main(argv: Sequence[str]) -> int:
    jobs, results = (int(fd) for fd in os.environ.pop(FDS_ENV).split(","))
    added = [name for name in SERVER_ENV if name not in os.environ]
    os.environ.update({name: SERVER_ENV[name] for name in added})
    server = Server(jobs, results, added)
    worker_reads.start()  # until the run loop: what import and collection read
    try:
        code = int(pytest.main(list(argv), plugins=[server]))
    finally:
        worker_reads.stop()
    if server.in_child:  # the job's pytest session is over: exit as its process would
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        atexit._run_exitfuncs()
        os._exit(code)
    if not server.answered:
        server.send(event="refused", reason=f"pytest ended before collecting (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
