"""Where the sweep's pytest processes run: the executor seam, and the local process pool.

The sweep (runner) describes each process as a `Launch` and hands it to an
`Executor`, which runs it to completion and leaves its records directory and log in
`raw/` as if it had run here: records stay the only interface. `LocalExecutor` (the
default) runs it as a subprocess of this machine; ray_executor as a Ray task, and
executors picks one by name (so neither of the two imports the other's module).

`WatchedProcess` is the one process runner both use (Ray on the node): the command in
its own session under a stall watchdog, so a hang is killed and a Ctrl-C kills it. As
it runs it yields the new complete lines of its records files (and of its log, when
asked), which is how progress and Ray's streaming both see finished tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from ..records import FILE_GLOB
from . import worker_reads

SWEEP_TMP_ENV = "CAPSAFE_SWEEP_TMP"
"""Set for every test process: a fresh empty directory of its own, removed afterwards."""
SWEEP_SHARED_ENV = "CAPSAFE_SWEEP_SHARED"
"""Set for every test process: one directory shared by all processes of this sweep.

For suites that keep state across processes on purpose (the planted flaky suite
counts its invocations there, so its nondeterminism is the same in every sweep).
"""
TEARDOWN_MARK = b'"phase":"teardown"'  # one per finished test in a records file
POLL_S = 0.05


OUTER_PYTEST_VARIABLES = ("PYTEST_CURRENT_TEST", *worker_reads.VARIABLES)
"""What a pytest running the sweep (a test of it, under xdist) sets for its own process: a
test process of the sweep inheriting them would look like an xdist worker of that outer
run to its plugins (pytest-benchmark's "xdist active" warning, an error under a project's
`filterwarnings = error`, refused every fork server of the project's own suite)."""


def inherited_environ() -> dict[str, str]:
    """The sweep's environment as its test processes start from it."""
    return {k: v for k, v in os.environ.items() if k not in OUTER_PYTEST_VARIABLES}


@dataclass(frozen=True)
class Launch:
    """One pytest process the sweep wants run."""

    label: str
    cmd: tuple[str, ...]
    cwd: Path
    env: Mapping[str, str]  # what the sweep sets on top of the environment
    records: Path  # the directory the command writes its records into (--capsafe-records)
    log: Path  # where its stdout and stderr go
    stall_limit: float  # seconds without output before the watchdog kills it
    gpus: tuple[str, ...] = ()  # the devices the command was given (--capsafe-gpus)


@dataclass(frozen=True)
class Exit:
    """How a launched process ended."""

    returncode: int
    stalled: bool = False  # the watchdog killed it
    interrupted: bool = False  # stopped by Ctrl-C or `kill_all`
    lost: str = ""  # why the executor lost it (a Ray worker or node died), "" when it did not


class Process(Protocol):
    """What `WatchedProcess` needs of the process it watches: a `subprocess.Popen`, or a
    fork server's child (fork_client.ForkedJob)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> Any: ...  # None while it runs: Popen's own type (`int | Any`)

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class Executor(Protocol):
    def execute(
        self, launch: Launch, on_tests: Callable[[int], None], stopping: threading.Event
    ) -> Exit:
        """Run `launch` to its end; call `on_tests` with how many more tests finished as they
        do; stop it (interrupted) once `stopping` is set."""
        ...

    def kill_all(self) -> None:
        """Stop every process this executor runs now (Ctrl-C, an error in another thread)."""
        ...


def teardowns(chunk: Chunk) -> int:
    """Tests a chunk of records lines finished."""
    return sum(lines.count(TEARDOWN_MARK) for lines in chunk.records.values())


@dataclass
class Chunk:
    """What a watched process wrote since the last chunk: appended bytes of each records
    file (by name), of the log, and, in the last chunk only, the other files of the
    records directory whole (neighbour status, phase marks: written once at the end)."""

    records: dict[str, bytes] = field(default_factory=dict)
    log: bytes = b""
    whole: dict[str, bytes] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.records or self.log or self.whole)


class WatchedProcess:
    """One command in its own session, under a stall watchdog, with a scratch directory."""

    def __init__(
        self,
        cmd: tuple[str, ...],
        cwd: Path,
        env: Mapping[str, str],
        records: Path,
        log: Path,
        stall_limit: float,
        *,
        tail_log: bool = False,
        min_interval: float = 0.0,
    ) -> None:
        self.cmd, self.cwd, self.env = cmd, cwd, env
        self.records, self.log, self.stall_limit = records, log, stall_limit
        self.tail_log, self.min_interval = tail_log, min_interval
        self.proc: Process | None = None
        self._offsets: dict[Path, int] = {}
        self._out: IO[bytes] | None = None
        self._scratch = ""

    def start(self) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        self._scratch = tempfile.mkdtemp(prefix="capsafe-proc-")
        self._out = open(self.log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            self.cmd, cwd=self.cwd, env={**self.env, SWEEP_TMP_ENV: self._scratch},
            stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def chunks(self, stopping: threading.Event) -> Iterator[Chunk]:
        """Wait for the process, yielding what it writes; `exit` says how it ended.
        KeyboardInterrupt once `stopping` is set (the caller kills it)."""
        assert self.proc is not None, "start() first"
        last_size, changed, sent = -1, time.monotonic(), 0.0
        stalled = False
        while True:
            try:
                self.proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if stopping.is_set():
                raise KeyboardInterrupt
            size = self.output_size()
            now = time.monotonic()
            if size != last_size:
                last_size, changed = size, now
                if now - sent >= self.min_interval and (chunk := self._tail(final=False)):
                    sent = now
                    yield chunk
            elif now - changed > self.stall_limit:
                self.kill()
                stalled = True
                break
        self.exit = Exit(self.proc.returncode, stalled=stalled)
        if chunk := self._tail(final=True):
            yield chunk

    def output_size(self) -> int:
        """Bytes written so far: the stall watchdog kills a process whose count stands still."""
        return path_size(self.records) + path_size(self.log)

    def _tail(self, *, final: bool) -> Chunk:
        chunk = Chunk()
        for path in sorted(self.records.glob(FILE_GLOB)):
            if new := self._read_new(path, final):
                chunk.records[path.name] = new
        if self.tail_log:
            chunk.log = self._read_new(self.log, final)
        if final:
            for path in sorted(self.records.iterdir()):
                if path.is_file() and not path.match(FILE_GLOB):
                    chunk.whole[path.name] = path.read_bytes()
        return chunk

    def _read_new(self, path: Path, final: bool) -> bytes:
        """The bytes of `path` not read yet: up to its last newline, or all when `final`
        (a line still being written waits for the next call)."""
        start = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return b""
        end = len(data) if final else data.rfind(b"\n") + 1
        self._offsets[path] = start + end
        return data[:end]

    def kill(self) -> None:
        """Kill the process and everything in its session (no-op once it is gone)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        if self._out is not None:
            self._out.close()
            self._out = None
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)


class LocalExecutor:
    """Today's process pool: each launch a subprocess of this machine."""

    def __init__(self) -> None:
        self._live: set[WatchedProcess] = set()
        self._lock = threading.Lock()

    def execute(
        self, launch: Launch, on_tests: Callable[[int], None], stopping: threading.Event
    ) -> Exit:
        proc = self.watched(launch, {**inherited_environ(), **launch.env})
        try:
            with self._lock:
                self._live.add(proc)
            proc.start()
            for chunk in proc.chunks(stopping):
                on_tests(teardowns(chunk))
            return proc.exit
        except KeyboardInterrupt:
            proc.kill()
            return Exit(proc.proc.returncode if proc.proc else -signal.SIGINT, interrupted=True)
        finally:  # never leave a test process behind
            proc.close()
            with self._lock:
                self._live.discard(proc)

    def watched(self, launch: Launch, env: Mapping[str, str]) -> WatchedProcess:
        """The process that runs `launch` (a subclass may run it elsewhere: fork_executor)."""
        return WatchedProcess(launch.cmd, launch.cwd, env, launch.records, launch.log,
                              launch.stall_limit)  # fmt: skip

    def kill_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for proc in live:
            proc.kill()


def path_size(path: Path) -> int:
    if path.is_dir():
        return sum(path_size(p) for p in path.iterdir())
    try:
        return path.stat().st_size
    except OSError:
        return 0
