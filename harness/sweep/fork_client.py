"""The sweep's end of a fork server: start one, submit jobs, wait for or kill each.

`ForkServer.start` launches the server (fork_server) for one suite root, one pytest
command line and one environment (with it one CUDA_VISIBLE_DEVICES value), and
waits until it has collected: `Refused` (with the reason the report quotes) when it
may not fork or could not collect, and the caller runs fresh processes instead.
`submit` hands it a job and returns a `ForkedJob` once the child runs; several
may be outstanding at once (the two halves of a pair run). A `ForkedJob` is waited
for and killed like a `subprocess.Popen`, and its returncode is a fresh process's:
the exit status, or minus the signal that killed it.

One reader thread per server (in the sweep, never in the server) takes the server's
answers and hands each to the job it names. When the server dies, its children are
killed (they would run unwatched) and every outstanding job ends as lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .fork_server import FDS_ENV, MODULE, Job, server_args

__all__ = ["ForkServer", "ForkedJob", "Refused"]

LOST = -signal.SIGKILL
"""The returncode of a job whose server died: its child was killed with it."""


class Refused(Exception):
    """The server will not fork (this job, or at all); the reason says why. `module`: the
    node id of the test module whose import initialised CUDA, `path` its file, where the
    server found one (a server that leaves it out may fork)."""

    def __init__(self, reason: str, module: str = "", path: str = "") -> None:
        super().__init__(reason)
        self.reason, self.module, self.path = reason, module, path


class ForkedJob:
    """One job's child process, as the sweep sees it: Popen's pid, returncode, wait, kill."""

    def __init__(self, server: ForkServer, job: Job) -> None:
        self.server, self.job = server, job
        self.pid = 0
        self.returncode: int | None = None
        self.lost = ""  # why it ended unseen (its server died), "" otherwise
        self.declined = ""  # why the server did not fork it
        self._started = threading.Event()
        self._done = threading.Event()

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; subprocess.TimeoutExpired after `timeout` seconds, as Popen."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.job.run_id, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """SIGKILL its process group, through the server (which alone knows whether the pid
        is still this child's); no-op once it has ended."""
        if self.returncode is None:
            self.server.send({"op": "kill", "job": self.job.job})

    # -- the reader thread's side ---------------------------------------------
    def _answer(self, message: Mapping[str, Any]) -> None:
        event = message["event"]
        if event == "started":
            self.pid = int(message["pid"])
            self._started.set()
        elif event == "declined":
            self.declined = str(message["reason"])
            self._end(LOST)
        elif event == "exit":
            self._end(int(message["returncode"]))

    def _end(self, returncode: int, lost: str = "") -> None:
        self.lost = lost
        self.returncode = returncode
        self._started.set()
        self._done.set()


class ForkServer:
    """A running fork server (see the module doc); `close` stops it."""

    def __init__(self, proc: subprocess.Popen[bytes], jobs: int, results: int, log: Path) -> None:
        self.proc, self.log = proc, log
        self.collected = 0
        # The collection as the capsafe plugin received it (before its reordering) and as it
        # ended (every plugin's changes): what a suite run's shares are planned from.
        self.received: tuple[str, ...] = ()
        self.items: tuple[str, ...] = ()
        self.errors = 0  # collection errors (an xdist run with any exits 1)
        self.dist = "no"  # xdist's --dist as the server's options say (addopts too)
        self.maxfail = 0  # -x / --maxfail: xdist stops every worker, a share only itself
        self.worker_reads: tuple[str, ...] = ()  # worker_reads.suite_reads: 'file:line'
        self._jobs, self._results = jobs, results
        self._lock = threading.Lock()
        self._outstanding: dict[str, ForkedJob] = {}
        self._next = 0
        self._ready = threading.Event()
        self._refusal = ""
        self._culprit = ("", "")  # a refusal's module node id and path, where one was found
        self._closed = False
        self._unreadable = ""  # why an answer could not be read: the server was ended for it
        self._jobs_open = True
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)

    @classmethod
    def start(
        cls,
        args: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        workdir: Path,
        timeout: float,
    ) -> ForkServer:
        """Start a server running pytest with `args` (a fresh replay's, without its
        JOB_OPTIONS) in `cwd` with `env`, its log and own records under `workdir`; return it
        once collected. Refused when it may not fork or did not get to serving in `timeout`."""
        server = cls.spawn(args, cwd, env, workdir)
        server.wait_ready(timeout)
        return server

    @classmethod
    def spawn(
        cls, args: Sequence[str], cwd: Path, env: Mapping[str, str], workdir: Path
    ) -> ForkServer:
        """Launch the server and return at once, before it has collected: `close()` may stop
        it while it collects (`wait_ready` then raises Refused)."""
        workdir.mkdir(parents=True, exist_ok=True)
        jobs_read, jobs_write = os.pipe()
        results_read, results_write = os.pipe()
        log = workdir / "server.log"
        cmd = [sys.executable, "-m", MODULE, *server_args(workdir / "records", args)]
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    cmd, cwd=cwd, env={**env, FDS_ENV: f"{jobs_read},{results_write}"},
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    pass_fds=(jobs_read, results_write), start_new_session=True,
                )  # fmt: skip
        except BaseException:
            os.close(jobs_write)
            os.close(results_read)
            raise
        finally:
            os.close(jobs_read)
            os.close(results_write)
        server = cls(proc, jobs_write, results_read, log)
        server._reader.start()
        return server

    def wait_ready(self, timeout: float) -> None:
        """Wait until the server has collected; Refused (and the server stopped) when it may
        not fork, could not collect, was closed meanwhile, or took longer than `timeout`."""
        if not self._ready.wait(timeout):
            self.close()
            raise Refused(f"the fork server did not collect within {timeout:g}s (see {self.log})")
        if self._refusal:
            self.close()
            raise Refused(self._refusal, *self._culprit)

    @property
    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def submit(self, job: Job) -> ForkedJob:
        """Fork a child for `job` and return it once it runs; Refused when the server will
        not fork now (the caller runs it as a fresh process) or has died."""
        handle = ForkedJob(self, job)
        with self._lock:
            if not self.alive:
                raise Refused("the fork server is not running")
            self._outstanding[job.job] = handle
        self._write(job.to_json())
        try:
            handle._started.wait()
        except BaseException:  # Ctrl-C: the server reads this after the job, and kills its
            handle.kill()  # child (it never runs unwatched)
            raise
        if handle.declined or (handle.lost and not handle.pid):
            raise Refused(handle.declined or handle.lost)
        return handle

    def job_id(self) -> str:
        with self._lock:
            self._next += 1
            return str(self._next)

    def send(self, message: Mapping[str, Any]) -> None:
        self._write(json.dumps(message))

    def _write(self, line: str) -> None:
        with self._lock:
            if self._jobs_open:
                with contextlib.suppress(OSError):  # a dead server: the reader ends its jobs
                    os.write(self._jobs, (line + "\n").encode("utf-8"))

    def _close_jobs(self) -> None:
        with self._lock:
            if self._jobs_open:
                self._jobs_open = False
                os.close(self._jobs)

    def close(self) -> None:
        """Kill what still runs, stop the server and wait for it."""
        with self._lock:
            outstanding = list(self._outstanding.values())
        for handle in outstanding:
            handle.kill()
        self.send({"op": "stop"})
        self._closed = True
        self._close_jobs()
        if not self._ready.is_set():  # still collecting: it reads no stop, and has no child
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=30)

    # -- the reader thread ----------------------------------------------------
    def _read(self) -> None:
        """Take the server's answers until they end. One that cannot be read (not JSON, a
        field of another type) ends the server: nobody would be told anything after it, and
        a sweep waiting for "ready" waited out the whole start timeout (pytest 9.2 gives
        `maxfail` as None, which this thread once died on)."""
        with open(self._results, "rb") as answers:
            try:
                for line in answers:
                    self._take(json.loads(line))
            except (ValueError, TypeError, KeyError) as exc:
                self._unreadable = f"the fork server's answer could not be read ({exc!r})"
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        self._server_gone()

    def _take(self, message: Mapping[str, Any]) -> None:
        event = message["event"]
        if event == "ready":
            self.collected = int(message["collected"])
            self.received = tuple(message.get("received", ()))
            self.items = tuple(message.get("items", ()))
            self.errors = int(message.get("errors", 0))
            self.dist = str(message.get("dist", "no"))
            self.maxfail = int(message.get("maxfail") or 0)
            self.worker_reads = tuple(message.get("worker_reads", ()))
            self._ready.set()
        elif event == "refused":
            if not self._refusal:
                self._refusal = str(message["reason"])
                self._culprit = (str(message.get("module", "")), str(message.get("path", "")))
            self._ready.set()
        else:
            with self._lock:
                handle = self._outstanding.get(message["job"])
                if event in ("exit", "declined"):
                    self._outstanding.pop(message["job"], None)
            if handle is not None:
                handle._answer(message)

    def _server_gone(self) -> None:
        """The server's answers ended: kill its orphaned children, end their jobs as lost."""
        if not self._ready.is_set():
            exited = self.proc.wait()
            self._refusal = (self._refusal or self._unreadable
                             or f"the fork server exited ({exited}) before serving")  # fmt: skip
            self._ready.set()
        with self._lock:
            outstanding = list(self._outstanding.values())
            self._outstanding.clear()
        code = self.proc.poll()
        why = self._unreadable or (
            f"the fork server died ({code if code is not None else 'no exit status'})"
        )
        for handle in outstanding:
            if handle.pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(handle.pid, signal.SIGKILL)
            handle._end(LOST, lost=why)
        self._close_jobs()
