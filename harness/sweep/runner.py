"""The sweep's test processes: pytest command lines, each process run by an executor.

Every process runs through the sweep's executor (harness.sweep.executor: this machine by
default, or Ray) in its own session under a stall watchdog: one that writes nothing
for `stall_limit` seconds is killed and the test it was in is recorded as timed out,
so a hang never stops the sweep. One the executor lost (a Ray node died, twice) has
the test it was in crashed. How a process ended is a typed fact, `fold.RunOutcome`
(its exit, the watchdog's kill, the loss, the tests it was in), which the fold reads
beside the rows; no row is made up. `kill_all` (Ctrl-C, an exception in a worker
thread) kills every live process at once.

With `--gpus`, a process with xdist workers gets the whole device list (the plugin pins
each worker, harness.plugin.gpus) and a single process one device, round-robin.

pytest runs where `capsafe sweep` was invoked when the paths lie under it (as
`pytest PATH` does), so suites that open files relative to the repository root
work. Every capsafe option takes its value with `=`: pytest counts an argument
that names an existing path when it picks the rootdir, so `--capsafe-records DIR`
would make node ids depend on where --out is.

A process started `exclusive` runs with no other test process alive (a readers-writer
gate): the sweep uses it to confirm that a failure "alone" was not a collision with a
concurrent test in the same working directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..plugin.collection import COLLECT_OUT_ENV, PLUGIN, Collected, read_collected
from ..plugin.gpus import VISIBLE, as_spec
from ..records import Record, load_records
from ..verdicts import fold
from .bytecode import bytecode_env
from .executor import (
    SWEEP_SHARED_ENV,
    SWEEP_TMP_ENV,
    Executor,
    Launch,
    LocalExecutor,
    inherited_environ,
)
from .executors import make_executor
from .fork_executor import IN_PROCESS, NO_XDIST, ForkExecutor
from .optional_plugins import quiet_plugin_args
from .options import SweepError, SweepOptions

__all__ = [
    "PYTEST_NO_RUN",
    "SWEEP_SHARED_ENV",
    "SWEEP_TMP_ENV",
    "Interrupted",
    "ProcessResult",
    "Runner",
    "last_line",
    "run_directory",
    "suite_root",
    "usage_error_line",
]

PYTEST_COUNTS = re.compile(r"^=*\s*(\d+ \w+(, )?)+ in [\d.]+s\b|^=*\s*no tests ran in")
"""pytest's closing line: "5 passed, 1 skipped in 0.80s", with or without its ====."""
PYTEST_NO_RUN = (2, 3, 4, 5)  # interrupted, internal error, usage error, no tests collected


@dataclass
class ProcessResult:
    """One pytest subprocess: the rows it recorded and how it ended."""

    label: str
    rows: list[Record]
    end: fold.RunOutcome
    log: Path
    malformed: int = 0  # record lines that could not be read (skipped, counted in the notes)
    on_disk: bool = True  # `rows` are all its records under raw/ hold (Ctrl-C cut some off)

    @property
    def returncode(self) -> int:
        return self.end.returncode

    @property
    def stalled(self) -> bool:
        return self.end.stalled

    @property
    def killed_in(self) -> tuple[str, ...]:
        """The tests a stalled process was in when the watchdog killed it."""
        if not self.end.stalled or self.end.lost:
            return ()
        return tuple(sorted({k.nodeid for k in self.end.killed}))

    def attempts(self) -> dict[tuple[str, str], fold.Attempt]:
        """Its tests' attempts: its rows folded with how it ended."""
        return fold.attempts(self.rows, [self.end])


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while a test process ran: carries what that process finished before it died."""

    def __init__(self, result: ProcessResult) -> None:
        super().__init__()
        self.result = result


def suite_root(paths: Sequence[Path]) -> Path:
    """The common parent of the paths: where pytest runs when they lie outside the
    invocation directory."""
    if not paths:
        return Path.cwd()
    common = Path(os.path.commonpath([str(p) for p in paths]))
    return common if common.is_dir() else common.parent


def run_directory(paths: Sequence[Path], invoked_from: Path) -> Path:
    """Where pytest runs: the invocation directory when every path lies under it."""
    if all(p == invoked_from or invoked_from in p.parents for p in paths):
        return invoked_from
    return suite_root(paths)


class _Gate:
    """Many shared holders or one exclusive holder; a waiting exclusive one goes first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        with self._cond:
            if exclusive:
                self._waiting += 1
                while self._exclusive or self._shared:
                    self._cond.wait(0.1)
                self._waiting -= 1
                self._exclusive = True
            else:
                while self._exclusive or self._waiting:
                    self._cond.wait(0.1)
                self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                if exclusive:
                    self._exclusive = False
                else:
                    self._shared -= 1
                self._cond.notify_all()


class Runner:
    """Starts pytest subprocesses for one sweep and can kill all of them at once."""

    def __init__(
        self,
        options: SweepOptions,
        raw: Path,
        on_tests: Callable[[int], None] = lambda n: None,
        executor: Executor | None = None,
    ) -> None:
        self.options = options
        self.raw = raw
        self.shared = raw / "shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.cwd = run_directory(options.paths, options.invoked_from or Path.cwd())
        self.executor = executor or self._default_executor()
        self._fresh = LocalExecutor()  # processes in a scratch copy of the suite (`run(cwd=)`)
        self.rootdir = self.cwd  # where node ids are relative to: set by `collect`
        self.inifile = ""  # the configuration file collection found: set by `collect`
        self.project_timeout: float | None = None  # the project's own timeout: set by `collect`
        self.timeout_source = ""
        self.lines: dict[str, int] = {}  # node id -> the line it is defined on: set by `collect`
        self.project_timeout_method = ""
        self.stall_limit = options.stall_limit  # raised by `collect` for a longer project timeout
        self.stopping = threading.Event()
        self.on_tests = on_tests  # called with how many more tests finished, as they do
        self._lock = threading.Lock()
        self._gate = _Gate()
        self._groups: set[object] = set()  # tokens of `only()` blocks holding the gate
        self._gpu_of: dict[str, tuple[str, ...]] = {}  # run id -> the devices its command got
        self._single_processes = 0  # round-robin position of the next single process's GPU

    # -- commands -------------------------------------------------------------
    def targets(self) -> list[str]:
        return [os.path.relpath(p, self.cwd) for p in self.options.paths]

    def replay_targets(self, nodeids: Iterable[str]) -> list[str]:
        """The files holding `nodeids`, so a replay collects only those (else every path);
        each file looked up once (a pair screen names its cause hundreds of times)."""
        files: list[str] = []
        for path in dict.fromkeys(nodeid.split("::", 1)[0] for nodeid in nodeids):
            found = self.rootdir / path
            if not found.exists():
                return self.targets()
            rel = os.path.relpath(found, self.cwd)
            if rel not in files:
                files.append(rel)
        return files

    def pytest_command(
        self,
        targets: Sequence[str],
        records: Path | None,
        run_id: str | None,
        *,
        seed: int | None,
        workers: int,
        replay_file: Path | None = None,
        shuffle: str = "global",
        extra: Sequence[str] = (),
        root: Path | None = None,
    ) -> list[str]:
        """`root`: a scratch copy of the rootdir the process runs in instead (its rootdir, and
        its configuration file when that lies under the rootdir)."""
        o = self.options
        cmd = [sys.executable, "-m", "pytest", *targets, "-p", "capsafe"]
        cmd.append(f"--rootdir={root or self.rootdir}")  # the ids' root, whatever the targets
        if self.inifile:
            inifile = Path(self.inifile)
            cmd.append(f"--config-file={inifile if root is None else self.moved(inifile, root)}")
        if records is not None:
            cmd += [f"--capsafe-records={records}", f"--capsafe-run-id={run_id}"]
        if replay_file is not None:
            cmd.append(f"--capsafe-replay={replay_file}")
        elif seed is not None:
            cmd.append(f"--capsafe-shuffle={shuffle}")
        if seed is not None:
            cmd.append(f"--capsafe-seed={seed}")
        if workers:
            cmd.append(f"-n={workers}")
        else:  # one process: xdist as in the suite runs (see IN_PROCESS)
            cmd += [IN_PROCESS] if o.workers else NO_XDIST
        if self.project_timeout is None:  # the project's own setting wins
            cmd.append(f"--timeout={o.timeout:g}")
        if not self.project_timeout_method:
            cmd.append("--timeout-method=signal")
        cmd.append("--continue-on-collection-errors")
        if o.neighbors:
            cmd.append(f"--capsafe-neighbors={o.neighbors}")
        if o.threads > 1:
            cmd.append(f"--parallel-threads={o.threads}")
        if o.gpus and run_id is not None:
            devices = o.gpus if workers else self._next_gpu()
            self._gpu_of[run_id] = devices
            cmd.append(f"--capsafe-gpus={as_spec(devices)}")
        cmd += quiet_plugin_args(o.threads)
        return [*cmd, *extra, "-q", "-p", "no:cacheprovider", *o.pytest_args]

    def moved(self, path: Path, root: Path) -> Path:
        """`path` at its place under `root`, a scratch copy of the rootdir (unmoved when it
        lies outside the rootdir)."""
        try:
            return root / path.relative_to(self.rootdir)
        except ValueError:
            return path

    def rooted(self, root: Path, nodeids: Iterable[str]) -> tuple[Path, list[str]]:
        """(working directory, targets) of a replay in `root`: the sweep's working directory
        moved there when it lies under the rootdir (else `root` itself), and the files of
        `nodeids` in `root`, absolute."""
        cwd = self.moved(self.cwd, root)
        if cwd == self.cwd:
            cwd = root
        files = [str(root / n.split("::", 1)[0]) for n in nodeids]
        return cwd, list(dict.fromkeys(files))

    def _next_gpu(self) -> tuple[str, ...]:
        with self._lock:
            k, self._single_processes = self._single_processes, self._single_processes + 1
        return (self.options.gpus[k % len(self.options.gpus)],)

    def replay_command(self, replay_file: Path, nodeids: Sequence[str]) -> str:
        """A shell line a person can paste, from where `capsafe sweep` ran, to see the
        failure again: paths relative to there (--rootdir and --config-file stay: a replay
        collects single files, where pytest could find another ini), and `python` when that
        is this interpreter."""
        cmd = self.pytest_command(
            self.replay_targets(nodeids), None, None, seed=None, workers=0,
            replay_file=Path(os.path.relpath(replay_file, self.cwd)),
        )  # fmt: skip
        on_path = shutil.which("python")
        here_bin = Path(sys.executable).absolute().parent  # python3, python3.11: one venv
        if (
            on_path
            and Path(on_path).absolute().parent == here_bin
            and os.path.samefile(on_path, sys.executable)
        ):
            cmd[0] = "python"
        for k, arg in enumerate(cmd):
            flag, eq, value = arg.partition("=")
            if eq and flag in ("--rootdir", "--config-file"):
                cmd[k] = f"{flag}={os.path.relpath(value, self.cwd)}"
        here = self.options.invoked_from or Path.cwd()
        where = os.path.relpath(self.cwd, here)
        return shlex.join(cmd) if where == "." else f"cd {shlex.quote(where)} && {shlex.join(cmd)}"

    # -- collection -----------------------------------------------------------
    def collect(self) -> Collected:
        """The node ids `pytest --collect-only -q` prints here, and the collection errors;
        SweepError when pytest could not even get to collecting."""
        found = self.raw / "collected.json"
        log = self.raw / "collect.log"
        cmd = [sys.executable, "-m", "pytest", *self.targets(), "--collect-only", "-q",
               "-p", PLUGIN, "-p", "no:cacheprovider", *self.options.pytest_args]  # fmt: skip
        env = {**inherited_environ(), **bytecode_env(self.raw), COLLECT_OUT_ENV: str(found)}
        with open(log, "wb") as out:
            done = subprocess.run(
                cmd, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, timeout=max(600.0, self.options.stall_limit),
            )  # fmt: skip
        collected = read_collected(found)
        if collected is None:
            detail = usage_error_line(log) or f"see {log}"
            raise SweepError(f"pytest could not collect the suite (exit {done.returncode}): "
                             f"{detail}")  # fmt: skip
        self.pin(collected)
        return collected

    def pin(self, collected: Collected) -> None:
        """Every later process uses the rootdir and configuration file collection found."""
        self.rootdir = Path(collected.rootdir)
        self.inifile = collected.inifile
        self.project_timeout = collected.timeout
        self.lines = collected.lines
        self.timeout_source = collected.timeout_source
        self.project_timeout_method = collected.timeout_method
        if collected.timeout and self.options.stall_s is None:  # a hang still outlasts it
            self.stall_limit = max(self.options.stall_limit, 2 * collected.timeout + 30)

    def timeout_line(self) -> str:
        """Which per-test timeout the test processes ran under, for the report."""
        if self.project_timeout is None:
            return f"{self.options.timeout:g} s (--timeout; the project sets none)"
        seconds = f"{self.project_timeout:g} s" if self.project_timeout else "none"
        return f"{seconds} (the project's own: {self.timeout_source})"

    # -- processes ------------------------------------------------------------
    @contextlib.contextmanager
    def only(self) -> Iterator[object]:
        """Hold the gate for a group of processes started with `run(..., group=token)`
        while no other process of the sweep runs (two tests started side by side)."""
        token = object()
        with self._gate.hold(True):
            self._groups.add(token)
            try:
                yield token
            finally:
                self._groups.discard(token)

    def run(
        self,
        label: str,
        cmd: list[str],
        *,
        exclusive: bool = False,
        group: object = None,
        sequence: Sequence[str] = (),
        cwd: Path | None = None,
        under: Path | None = None,
    ) -> ProcessResult:
        """Run one pytest process to completion (or stall, or stop) and read its rows;
        `sequence`: the tests a replay runs, in order (where a lost one stopped). `cwd`: a
        working directory other than the sweep's (a scratch copy of the suite): the process
        then runs fresh on this machine, never forked from a server that imported the
        suite's own modules; `under`: the directory its records and log go in (raw/)."""
        where = under or self.raw
        records = where / label
        records.mkdir(parents=True, exist_ok=True)
        log = where / f"{label}.log"
        env = self.env()
        devices = self._gpu_of.pop(label, ())
        if len(devices) == 1:  # before the process starts, whatever its conftest does first
            env[VISIBLE] = devices[0]
        launch = Launch(label, tuple(cmd), cwd or self.cwd, env, records, log,
                        self.stall_limit, devices)  # fmt: skip
        held = group is not None and group in self._groups
        executor = self.executor if cwd is None else self._fresh
        with contextlib.nullcontext() if held else self._gate.hold(exclusive):
            if self.stopping.is_set():
                raise KeyboardInterrupt
            end = executor.execute(launch, self.on_tests, self.stopping)
        rows, malformed = load_records(records)
        if end.interrupted:  # the tests it was cut off in get no verdict
            cut = fold.RunOutcome(label, end.returncode)
            finished = fold.finished_rows(rows)
            raise Interrupted(ProcessResult(label, finished, cut, log, malformed,
                                            on_disk=len(finished) == len(rows)))  # fmt: skip
        killed = fold.killed(rows)
        if end.lost and not killed:
            killed = _lost_in(sequence, rows)
        outcome = fold.RunOutcome(
            label, end.returncode, stalled_after=self.stall_limit if end.stalled else None,
            lost=end.lost, killed=killed, gpu=devices[0] if len(devices) == 1 else "",
        )  # fmt: skip
        return ProcessResult(label, rows, outcome, log, malformed)

    def env(self) -> dict[str, str]:
        """What the sweep sets on top of the environment of each of its test processes."""
        return {**bytecode_env(self.raw), SWEEP_SHARED_ENV: str(self.shared)}

    def prestart_replays(self) -> None:
        """Start the fork server the replays will use now, while the suite runs, so its
        start-up and collection are not paid when the first rerun waits for it (a sweep
        pinned to GPUs has one per device, each started on first use)."""
        if not isinstance(self.executor, ForkExecutor) or self.options.gpus:
            return
        label = "prestart"  # only its command line counts: the server key is made from it
        cmd = self.pytest_command(self.targets(), self.raw / label, label, seed=0, workers=0,
                                  replay_file=self.raw / "replays" / f"{label}.txt")  # fmt: skip
        env = self.env()
        launch = Launch(label, tuple(cmd), self.cwd, env, self.raw / label,
                        self.raw / f"{label}.log", self.stall_limit, ())  # fmt: skip
        self.executor.prestart(launch, {**inherited_environ(), **env})

    def _default_executor(self) -> Executor:
        """Local replays are forked from a fork server unless --fresh-processes (or Ray)."""
        o = self.options
        if o.executor == "local" and o.fork:
            return ForkExecutor(self.targets(), self.raw / "fork-servers",
                                start_timeout=max(600.0, o.stall_limit))  # fmt: skip
        return make_executor(o.executor, o.address, gpus=bool(o.gpus))

    def kill_all(self) -> None:
        self.stopping.set()
        self.executor.kill_all()
        self._fresh.kill_all()

    def close(self) -> list[str]:
        """Stop the fork servers, if any; the lines the report gets about them."""
        if not isinstance(self.executor, ForkExecutor):
            return []
        self.executor.close()
        return self.executor.notes()


def _lost_in(sequence: Sequence[str], rows: Sequence[Record]) -> tuple[fold.Killed, ...]:
    """The first test of a lost replay that left no row (the process was in it, or about
    to be); none for a whole-suite run, whose order is not known here."""
    seen = {row["nodeid"] for row in rows}
    for index, nodeid in enumerate(sequence):
        if nodeid not in seen:
            return (fold.Killed(nodeid, "", index=index, at=time.time()),)
    return ()


def usage_error_line(log: Path) -> str:
    """What pytest said when it refused to start (exit 4): its `error:` line, not the
    rootdir/inifile lines it prints after it; a hint when what it refused is xdist's -n
    (the suite's ini or arguments load pytest without xdist: sweep with --workers 0)."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    argparse_errors = [m.group(1) for m in map(_ARGPARSE_ERROR.match, lines) if m]
    errors = argparse_errors or [line[len("ERROR: ") :] for line in lines
                                 if line.startswith("ERROR: ")]  # fmt: skip
    if not errors:
        return last_line(log)
    line = errors[-1].strip()
    if _XDIST_REFUSED.search(line):
        line += (" (pytest runs here without xdist, e.g. `-p no:xdist` in the suite's addopts: "
                 "sweep with --workers 0)")  # fmt: skip
    return line


_ARGPARSE_ERROR = re.compile(r"^[^:]+: error: (.+)$")  # the prog may be `python -m pytest`
_XDIST_REFUSED = re.compile(r"unrecognized arguments:.*(^|\s)(-n|--numprocesses|--dist)(=|\s|$)")


def last_line(log: Path, *, past_counts: bool = False) -> str:
    """A process log's last line (what pytest said last), '' when there is none;
    `past_counts`: the last line before pytest's closing counts ("5 passed in 0.8s"),
    which is where a session hook's error or a plugin's verdict stands."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    if past_counts:
        lines = [line for line in lines if line.strip() and not PYTEST_COUNTS.match(line)]
    return lines[-1].strip() if lines else ""
