"""Suite runs forked from a fork server: one child per xdist worker, each given its share.

A suite run is `pytest -n W --capsafe-shuffle=MODE --capsafe-seed=S`: every xdist worker
collects, the capsafe plugin shuffles what collection handed it by the seed, later plugins
may deselect, and the seeded scheduler deals the result round-robin (plugin.schedule). All
of it is a function of the collection, so the server, which collected once, says what
the plugin received and what collection ended with, and `plan_shares` computes each
worker's tests in order. The run is then W children of that server (`ForkedRun`), each the
worker it stands for (`worker_id`, `testrun_uid`, the PYTEST_XDIST_* variables, its records
as `gwK`), running its share as a replay does: interpreter start-up and collection are paid
once a sweep instead of W + 1 times a run.

Whether the plan is the run xdist would make is not assumed: the first suite run is an
xdist run, and `plan_differs` compares its records (each worker's tests in the order it
ran them) with the plan for its seed. Only a match lets later runs fork; a mismatch (a
plugin that reorders after capsafe, `--dist loadfile`, a module the server left out) keeps
every run fresh, and the report says why. A forked run one of whose children a signal
ended, or that exited as pytest does when it could not run (2, 3, 4), runs again fresh,
and only that run counts.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from ..plugin import order
from ..plugin.schedule import deal
from ..records import FILE_GLOB, Record
from .executor import SWEEP_TMP_ENV, Chunk, Launch, WatchedProcess, _size
from .fork_client import ForkedJob, ForkServer, Refused
from .fork_commands import PYTEST, SuiteRun
from .fork_server import Job

__all__ = ["ForkedRun", "plan_differs", "plan_shares"]

RAN = (0, 1, 5)
"""A share's exit codes of a run that ran: passed, failed, no tests (more workers than
tests). Any other (a signal, an internal or usage error) runs the run again fresh."""


def plan_shares(
    received: Sequence[str], items: Sequence[str], seed: int, shuffle: str, workers: int
) -> list[list[str]] | None:
    """Each worker's tests, in order, for a run with this seed and shuffle: what the plugin
    `received` shuffled, less what later plugins dropped (the final `items`), dealt. None
    when those plugins did more than drop tests (their order is not the received one's):
    then no share can be computed here."""
    kept = set(items)
    if len(kept) != len(items) or [n for n in received if n in kept] != list(items):
        return None
    ordered = [n for n in order.shuffled(received, seed, shuffle) if n in kept]
    return [[ordered[i] for i in share] for share in deal(len(ordered), workers)]


def worker_name(k: int) -> str:
    return f"gw{k}"


def plan_differs(shares: Sequence[Sequence[str]], rows: Sequence[Record]) -> str:
    """Why an xdist run's records are not the plan (each worker's tests, in the order it ran
    them); "" when they are."""
    ran: dict[str, dict[str, int]] = {}
    for row in rows:
        ran.setdefault(row["worker"], {}).setdefault(row["nodeid"], row["index"])
    expected = {worker_name(k): list(share) for k, share in enumerate(shares) if share}
    if set(ran) != set(expected):
        return f"its workers were {sorted(ran)}, the plan's {sorted(expected)}"
    for worker, share in sorted(expected.items()):
        seen = sorted(ran[worker], key=ran[worker].__getitem__)
        if seen != share:
            at = next((k for k, (a, b) in enumerate(zip(seen, share, strict=False)) if a != b),
                      min(len(seen), len(share)))  # fmt: skip
            return (f"{worker}'s test {at + 1} was {_name(seen, at)} where the plan has "
                    f"{_name(share, at)}")  # fmt: skip
    return ""


def _name(tests: Sequence[str], at: int) -> str:
    return tests[at] if at < len(tests) else "none"


def run_returncode(codes: Sequence[int]) -> int:
    """The run's exit code from its shares', as xdist's controller would give it."""
    odd = [code for code in codes if code not in RAN]
    if odd:
        return odd[0]
    if 1 in codes:
        return 1
    return 0 if 0 in codes else 5


class JobGroup:
    """A forked run's children as one process (executor.Process): done when all are."""

    def __init__(self, jobs: Sequence[ForkedJob]) -> None:
        self.jobs = tuple(jobs)

    @property
    def pid(self) -> int:
        return self.jobs[0].pid

    @property
    def returncode(self) -> int | None:
        codes = [job.returncode for job in self.jobs]
        if any(code is None for code in codes):
            return None
        return run_returncode([code for code in codes if code is not None])

    @property
    def lost(self) -> str:
        return next((job.lost for job in self.jobs if job.lost), "")

    def wait(self, timeout: float | None = None) -> int:
        until = None if timeout is None else time.monotonic() + timeout
        for job in self.jobs:
            left = None if until is None else max(0.0, until - time.monotonic())
            job.wait(left)  # subprocess.TimeoutExpired, as Popen's
        code = self.returncode
        assert code is not None
        return code

    def kill(self) -> None:
        for job in self.jobs:
            job.kill()
        for job in self.jobs:
            job.wait()


class ForkedRun(WatchedProcess):
    """A suite run as one child per worker share (see the module doc); the xdist run after
    all when the server declines a share."""

    def __init__(
        self,
        server: ForkServer,
        run: SuiteRun,
        shares: Sequence[Sequence[str]],
        launch: Launch,
        env: Mapping[str, str],
        on_refused: Callable[[str], None],
    ) -> None:
        super().__init__(launch.cmd, launch.cwd, env, launch.records, launch.log,
                         launch.stall_limit)  # fmt: skip
        self.server, self.run, self.on_refused = server, run, on_refused
        self.shares = [(worker_name(k), tuple(s)) for k, s in enumerate(shares) if s]
        self.overrides = dict(launch.env)  # what the sweep sets: the server has it already
        self.forked = False

    def share_log(self, worker: str) -> Path:
        return self.log.with_name(f"{self.log.stem}.{worker}{self.log.suffix}")

    def start(self) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix="capsafe-proc-")  # one per run, as xdist's workers
        uid = uuid.uuid4().hex
        replay = self.run.replay
        started: list[ForkedJob] = []
        try:
            for worker, share in self.shares:
                job = Job(
                    job=self.server.job_id(), nodeids=share, records=str(self.records),
                    run_id=replay.run_id, log=str(self.share_log(worker)), seed=replay.seed,
                    env={**self.overrides, SWEEP_TMP_ENV: scratch},
                    neighbors=replay.neighbors, neighbor_calls=replay.neighbor_calls,
                    protect=replay.protect, watch_env=replay.watch_env,
                    argv=tuple(self.cmd[len(PYTEST) + 1 :]), worker=worker,
                    workers=len(self.shares), testrun_uid=uid,
                )  # fmt: skip
                started.append(self.server.submit(job))
        except Refused as refused:
            if started:
                JobGroup(started).kill()
            shutil.rmtree(scratch, ignore_errors=True)
            self._clear()
            self.on_refused(refused.reason)
            super().start()  # the xdist run
            return
        self._scratch = scratch  # removed by close(), as a fresh process's
        self.proc = JobGroup(started)
        self.forked = True

    def _clear(self) -> None:
        """What declined shares' siblings wrote: the xdist run starts from nothing."""
        for path in self.records.glob(FILE_GLOB):
            path.unlink(missing_ok=True)
        for worker, _ in self.shares:
            self.share_log(worker).unlink(missing_ok=True)

    def output_size(self) -> int:
        return super().output_size() + sum(_size(self.share_log(w)) for w, _ in self.shares)

    def chunks(self, stopping: threading.Event) -> Iterator[Chunk]:
        yield from super().chunks(stopping)
        if isinstance(self.proc, JobGroup) and self.proc.lost:
            self.exit = replace(self.exit, lost=self.proc.lost)

    def kill(self) -> None:
        if not isinstance(self.proc, JobGroup):
            super().kill()
        elif self.proc.returncode is None:
            self.proc.kill()

    def close(self) -> None:
        """As a fresh run's, and the shares' logs joined into the run's log, in worker order
        (each ends with its own pytest summary line)."""
        super().close()
        if not self.forked:
            return
        with open(self.log, "wb") as out:
            for worker, _ in self.shares:
                path = self.share_log(worker)
                try:
                    data = path.read_bytes()
                except OSError:
                    continue
                out.write(f"[{worker}]\n".encode())
                out.write(data if data.endswith(b"\n") or not data else data + b"\n")
                path.unlink(missing_ok=True)


def fresh_again(code: int | None) -> bool:
    """A forked run that ended so runs again as an xdist run (see RAN)."""
    return code is not None and code not in RAN
