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
from ..records import FILE_GLOB, Record, Signal, load_records
from .executor import SWEEP_TMP_ENV, Chunk, Launch, WatchedProcess, path_size, teardowns
from .fork_client import ForkedJob, ForkServer, Refused
from .fork_commands import PYTEST, SuiteRun
from .fork_server import Job

__all__ = [
    "ForkedRun",
    "JobGroup",
    "ServedProcess",
    "fresh_again",
    "plan_differs",
    "plan_shares",
    "run_returncode",
    "unplannable",
]

RAN = (0, 1, 5)
"""A share's exit codes of a run that ran: passed, failed, no tests (more workers than
tests). Any other (a signal, an internal or usage error) runs the run again fresh."""


def unplannable(server: ForkServer) -> str:
    """Why a suite run cannot be planned from this server's collection; "" when it can."""
    if len(set(server.items)) != len(server.items):
        return "the suite collects one node id twice"
    if server.dist not in ("no", "load"):
        return f"xdist schedules it with --dist {server.dist}, not the seeded split"
    if server.maxfail:
        return "-x/--maxfail stops every xdist worker at once, a forked share only itself"
    if server.worker_reads:
        shown = ", ".join(server.worker_reads[:3])
        return (f"the suite reads xdist's worker variables before its tests run ({shown}), "
                "which a forked worker sets only after")  # fmt: skip
    kept = set(server.items)
    if [n for n in server.received if n in kept] != list(server.items):
        return "a plugin reorders the tests after capsafe's shuffle"
    return ""


def plan_shares(
    received: Sequence[str], items: Sequence[str], seed: int, shuffle: str, workers: int
) -> list[list[str]]:
    """Each worker's tests, in order, for a run with this seed and shuffle: what the plugin
    `received` shuffled, less what later plugins dropped (the final `items`), dealt. Only
    for a collection `unplannable` passes."""
    kept = set(items)
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


def run_returncode(codes: Sequence[int], collect_errors: bool = False) -> int:
    """The run's exit code from its shares', as xdist's controller would give it (a
    collection error fails the run: a child starts with the server's errors cleared)."""
    odd = [code for code in codes if code not in RAN]
    if odd:
        return odd[0]
    if 1 in codes or collect_errors:
        return 1
    return 0 if 0 in codes else 5


def fresh_again(code: int | None) -> bool:
    """A forked run that ended so runs again as an xdist run (see RAN)."""
    return code is not None and code not in RAN


class JobGroup:
    """A forked run's children as one process (executor.Process): done when all are."""

    def __init__(self, jobs: Sequence[ForkedJob], collect_errors: bool = False) -> None:
        assert jobs, "a run has a share at least"
        self.jobs = tuple(jobs)
        self.collect_errors = collect_errors

    @property
    def pid(self) -> int:
        return self.jobs[0].pid

    @property
    def returncode(self) -> int | None:
        codes = [job.returncode for job in self.jobs]
        if any(code is None for code in codes):
            return None
        return run_returncode([c for c in codes if c is not None], self.collect_errors)

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


class ServedProcess(WatchedProcess):
    """A process a fork server runs (a replay's child, or a run's children), watched as a
    fresh one: `forked` once the server runs it, a fresh process when it declines."""

    forked = False

    def chunks(self, stopping: threading.Event) -> Iterator[Chunk]:
        yield from super().chunks(stopping)
        lost = getattr(self.proc, "lost", "") if self.forked else ""
        if lost:
            self.exit = replace(self.exit, lost=lost)

    def kill(self) -> None:
        """Its children's process groups, killed by the server (which knows each pid is
        still its child's)."""
        if not self.forked:
            super().kill()
        elif self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            self.proc.wait()


class ForkedRun(ServedProcess):
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
        self._joined = False
        self.finished = 0  # teardown rows seen so far

    def share_log(self, worker: str) -> Path:
        return self.log.with_name(f"{self.log.stem}.{worker}{self.log.suffix}")

    def start(self) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        self._scratch = tempfile.mkdtemp(prefix="capsafe-proc-")  # one a run, as xdist's
        uid = uuid.uuid4().hex
        replay = self.run.replay
        started: list[ForkedJob] = []
        try:
            for worker, share in self.shares:
                job = Job(
                    job=self.server.job_id(), nodeids=share, records=str(self.records),
                    run_id=replay.run_id, log=str(self.share_log(worker)), seed=replay.seed,
                    env={**self.overrides, SWEEP_TMP_ENV: self._scratch},
                    neighbors=replay.neighbors, neighbor_calls=replay.neighbor_calls,
                    protect=replay.protect, watch_env=replay.watch_env,
                    argv=tuple(self.cmd[len(PYTEST) + 1 :]), worker=worker,
                    workers=self.run.workers, testrun_uid=uid,
                )  # fmt: skip
                started.append(self.server.submit(job))
        except Refused as refused:
            self._abandon(started)
            self.on_refused(refused.reason)
            super().start()  # the xdist run
            return
        except BaseException:  # Ctrl-C: no share runs on unwatched
            self._abandon(started)
            raise
        self.proc = JobGroup(started, collect_errors=bool(self.server.errors))
        self.forked = True

    def _abandon(self, started: Sequence[ForkedJob]) -> None:
        """Kill the shares started and drop what they wrote: the xdist run (or none) starts
        from nothing."""
        if started:
            JobGroup(started).kill()
        shutil.rmtree(self._scratch, ignore_errors=True)
        self._scratch = ""
        for path in self.records.glob(FILE_GLOB):
            path.unlink(missing_ok=True)
        for worker, _ in self.shares:
            self.share_log(worker).unlink(missing_ok=True)

    def chunks(self, stopping: threading.Event) -> Iterator[Chunk]:
        for chunk in super().chunks(stopping):
            self.finished += teardowns(chunk)  # as the executor counts them, for `incomplete`
            yield chunk

    def incomplete(self) -> str:
        """The first test of a share that never finished (no teardown row, no crash row)
        though its child ended by itself: xdist would have run it on a new worker. The
        records are read only when fewer teardowns than tests went by (a run's records are
        read once more by the runner: 54 ms for 2,000 tests)."""
        if self.finished >= sum(len(share) for _, share in self.shares):
            return ""
        rows, _ = load_records(self.records)
        done = {r["nodeid"] for r in rows
                if r["phase"] == "teardown" or Signal.CRASH in r["signals"]}  # fmt: skip
        return next((n for _, share in self.shares for n in share if n not in done), "")

    def output_size(self) -> int:
        return super().output_size() + sum(path_size(self.share_log(w)) for w, _ in self.shares)

    def close(self) -> None:
        """As a fresh run's, and the shares' logs joined into the run's log, in worker order
        with the failed ones last (the run's last line is then a failure's, as xdist's)."""
        super().close()
        if not self.forked or self._joined:
            return
        self._joined = True
        codes = dict(zip((w for w, _ in self.shares), self._codes(), strict=True))
        workers = sorted(codes, key=lambda w: codes[w] not in (0, 5))  # stable: worker order
        with open(self.log, "wb") as out:
            for worker in workers:
                path = self.share_log(worker)
                try:
                    data = path.read_bytes()
                except OSError:
                    continue
                out.write(f"[{worker}]\n".encode())
                out.write(data if data.endswith(b"\n") or not data else data + b"\n")
                path.unlink(missing_ok=True)

    def _codes(self) -> list[int | None]:
        return [job.returncode for job in self.proc.jobs] if isinstance(self.proc, JobGroup) \
            else [None] * len(self.shares)  # fmt: skip
