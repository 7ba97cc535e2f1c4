"""The local executor with fork servers: replays and suite runs forked from a collected pytest.

`ForkExecutor` is a `LocalExecutor` whose replay launches (one process, `-n=0` or `-p no:xdist`,
`--capsafe-replay=FILE`: the sweep's isolation reruns, search and trial replays,
screens, sequence checks and each half of a pair run) run as children of a fork
server (fork_server, fork_client) instead of fresh interpreters, and whose suite runs
(`-n=W` with a seeded shuffle) run as one child per xdist worker once the first xdist run
showed that the shares planned from the server's collection are xdist's (fork_runs).
Everything else, and every launch the servers refuse, runs as a fresh process, exactly as
in `LocalExecutor`.

The launch is the same either way: its command line is split (fork_commands) into the
options a job sets for itself and the rest, and the rest, with the suite's own targets in
place of the replay's files, is the server's command line. One server runs per distinct
rest, working directory and environment (so one per pinned GPU: CUDA_VISIBLE_DEVICES is in
the environment), started on first use. A server that refuses is not asked again;
`refusals` keeps its reason for the report. The child is watched as a fresh process is
(`WatchedProcess`: the stall watchdog reads its records and log), so a hang, a crash or an
`os._exit` ends it with the rows written so far kept, as for a fresh process. A child that
a signal ended (a crash, not the watchdog's kill) runs again fresh, and only that run
counts: the fresh process is the reference.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..plugin import order
from ..records import Record, Signal, load_records
from .executor import (
    SWEEP_TMP_ENV,
    Exit,
    Launch,
    LocalExecutor,
    WatchedProcess,
    inherited_environ,
)
from .fork_client import ForkServer, Refused
from .fork_commands import IN_PROCESS, NO_XDIST, PYTEST, Replay, SuiteRun, split_replay, split_run
from .fork_runs import (
    ForkedRun,
    ServedProcess,
    fresh_again,
    plan_differs,
    plan_shares,
    unplannable,
)
from .fork_server import Job

__all__ = ["IN_PROCESS", "NO_XDIST", "ForkExecutor", "split_replay"]

MAX_LEFT_OUT = 3
"""Test modules whose import initialises CUDA a server leaves out before it gives up (each
costs it one more start and collection); their replays run fresh."""


class ForkedProcess(ServedProcess):
    """A replay run as a fork server's child, watched like a fresh process; a fresh one
    after all when the server declines it."""

    def __init__(
        self,
        server: ForkServer,
        replay: Replay,
        launch: Launch,
        env: Mapping[str, str],
        on_refused: Callable[[str], None],
        collect: tuple[str, ...] = (),
    ) -> None:
        """`collect`: paths of modules the server left out, for the child to collect."""
        super().__init__(launch.cmd, launch.cwd, env, launch.records, launch.log,
                         launch.stall_limit)  # fmt: skip
        self.server, self.replay, self.on_refused = server, replay, on_refused
        self.collect = collect
        self.overrides = dict(launch.env)  # what the sweep sets: the server has it already

    def start(self) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix="capsafe-proc-")
        job = Job(
            job=self.server.job_id(),
            nodeids=tuple(order.read_replay(self.replay.replay_file)),
            records=str(self.records),
            run_id=self.replay.run_id,
            log=str(self.log),
            seed=self.replay.seed,
            env={**self.overrides, SWEEP_TMP_ENV: scratch},
            replay_file=self.replay.replay_file,
            neighbors=self.replay.neighbors,
            neighbor_calls=self.replay.neighbor_calls,
            protect=self.replay.protect,
            watch_env=self.replay.watch_env,
            argv=tuple(self.cmd[len(PYTEST) + 1 :]),  # a fresh `python -m pytest ARGS`'s
            collect=self.collect,
        )
        try:
            self.proc = self.server.submit(job)
        except Refused as refused:
            shutil.rmtree(scratch, ignore_errors=True)
            self.on_refused(refused.reason)
            super().start()
            return
        self._scratch = scratch  # removed by close(), as a fresh process's
        self.forked = True


class ForkExecutor(LocalExecutor):
    """`LocalExecutor` with replays forked from per-key servers (see the module doc).

    `targets`: the suite's paths as the sweep's command lines give them (relative to the
    working directory), which each server collects. `workdir`: where servers keep their
    logs. `start_timeout`: seconds a server may take to collect before it counts as
    refused."""

    def __init__(self, targets: Sequence[str], workdir: Path, start_timeout: float) -> None:
        super().__init__()
        self.targets = tuple(targets)
        self.workdir = workdir
        self.start_timeout = start_timeout
        self.refusals: dict[str, str] = {}  # server key text -> why it does not fork
        self.forked = 0  # launches run as forked children
        self.fresh = 0  # replay launches run fresh because a server refused
        self.crashed: list[str] = []  # labels of forked children a signal ended: rerun fresh
        self._forked_procs: dict[int, ForkedProcess | ForkedRun] = {}  # id(launch) -> its process
        self._fresh_launches: set[int] = set()  # id(launch): run fresh, whatever the server
        self._servers: dict[tuple[object, ...], ForkServer | None] = {}
        self._starting: dict[tuple[object, ...], threading.Lock] = {}
        self._spawned: list[ForkServer] = []  # every server launched, collecting or serving
        self.unforkable: dict[str, str] = {}  # module node id -> why the server left it out
        self.unforkable_paths: dict[str, str] = {}  # module node id -> its path
        # Suite runs: True once the first xdist run matched the plan (fork_runs), the reason
        # when it did not, None before that; and how many ran forked.
        self.run_plan: bool | str | None = None
        self.runs_forked = 0
        self.undecided: list[str] = []  # xdist runs that could not check the plan, and why
        self._run_shares: dict[int, tuple[SuiteRun, list[list[str]]]] = {}  # id(launch) ->
        self._closing = False
        self._count = threading.Lock()

    def prestart(self, launch: Launch, env: Mapping[str, str]) -> None:
        """Start, in the background, the server that replays like `launch` will use, so its
        start-up and collection overlap the suite runs instead of delaying the first rerun
        (on the H200, ~4 s of a 60 s CuPy sweep). A replay that comes first waits for it."""
        replay = split_replay(launch.cmd)
        if replay is None:
            return
        threading.Thread(target=self._server, args=(launch, replay, env),
                         name="capsafe-fork-prestart", daemon=True).start()  # fmt: skip

    def execute(
        self, launch: Launch, on_tests: Callable[[int], None], stopping: threading.Event
    ) -> Exit:
        """As LocalExecutor's; a forked child that a signal ended (a crash, not the
        watchdog's kill or a stop) runs again as a fresh process, and only that run counts.
        The fresh process is the reference: on the H200 every forked child of a torch suite
        with neighbour threads crashed in torch's CUDA start, which no fresh process does,
        and the crashes read as test failures (fork_server._torch_cuda_first)."""
        run = split_run(launch.cmd)
        if run is not None:
            shares = self._shares(launch, run)
            if shares is None:  # the xdist run, which the first one always is
                end = super().execute(launch, on_tests, stopping)
                self._check_plan(launch, run, end)
                return end
            with self._count:
                self._run_shares[id(launch)] = (run, shares)
        try:
            end = super().execute(launch, on_tests, stopping)
        finally:
            with self._count:
                proc = self._forked_procs.pop(id(launch), None)
        ended = end.stalled or end.interrupted
        if isinstance(proc, ForkedRun):  # the server's death too: the xdist run is ours to run
            crashed = (
                not ended
                and proc.forked
                and bool(fresh_again(end.returncode) or end.lost or proc.incomplete())
            )
        else:
            crashed = end.returncode < 0 and not (ended or end.lost)
        if proc is None or not proc.forked or not crashed or stopping.is_set():
            return end
        with self._count:
            self.crashed.append(launch.label)
            self._fresh_launches.add(id(launch))
            if isinstance(proc, ForkedRun):
                self.runs_forked -= 1  # it ran under xdist after all
        shutil.rmtree(launch.records, ignore_errors=True)  # the crashed child's rows
        launch.log.unlink(missing_ok=True)
        try:
            return super().execute(launch, on_tests, stopping)
        finally:
            with self._count:
                self._fresh_launches.discard(id(launch))

    def watched(self, launch: Launch, env: Mapping[str, str]) -> WatchedProcess:
        with self._count:
            fresh = id(launch) in self._fresh_launches
            planned = self._run_shares.pop(id(launch), None)
        if planned is not None and not fresh:
            return self._forked_run(launch, env, *planned)
        replay = None if fresh else split_replay(launch.cmd)
        server = self._server(launch, replay, env) if replay is not None else None
        if replay is None or server is None:
            if replay is not None:
                self._counted(fresh=1)
            return super().watched(launch, env)

        def refused(reason: str) -> None:
            self._counted(fresh=1, forked=-1)
            with self._count:
                self.refusals.setdefault(f"{launch.cwd}, before a fork", reason)  # the first

        self._counted(forked=1)
        proc = ForkedProcess(server, replay, launch, env, refused, self._left_out(replay))
        with self._count:
            self._forked_procs[id(launch)] = proc
        return proc

    def _forked_run(
        self, launch: Launch, env: Mapping[str, str], run: SuiteRun, shares: list[list[str]]
    ) -> WatchedProcess:
        server = self._server(launch, run.replay, env)
        if server is None:
            return super().watched(launch, env)

        def refused(reason: str) -> None:
            with self._count:
                self.runs_forked -= 1
                self.refusals.setdefault(f"{launch.cwd}, before a suite run's fork", reason)

        with self._count:
            self.runs_forked += 1
        proc = ForkedRun(server, run, shares, launch, env, refused)
        with self._count:
            self._forked_procs[id(launch)] = proc
        return proc

    def _shares(self, launch: Launch, run: SuiteRun) -> list[list[str]] | None:
        """Each worker's tests for this run, once the first xdist run matched the plan;
        None when the run is to run under xdist."""
        with self._count:
            if self.run_plan is not True:
                return None
        server = self._server(launch, run.replay, {**inherited_environ(), **launch.env})
        if server is None or run.replay.seed is None or unplannable(server):
            return None
        return plan_shares(server.received, server.items, run.replay.seed, run.shuffle,
                           run.workers)  # fmt: skip

    def _check_plan(self, launch: Launch, run: SuiteRun, end: Exit) -> None:
        """After an xdist run, before any forked one: do its records follow the plan for its
        seed? Decided by the first run that ended cleanly (no crash, stall or stop)."""
        with self._count:
            if self.run_plan is not None or self._closing or end.interrupted:
                return  # a stopped sweep runs no next run
        rows, _ = load_records(launch.records)
        unclean = _unclean(end, rows)
        if unclean:
            with self._count:
                self.undecided.append(f"{launch.label} ({unclean})")
            return  # the next run decides
        server = self._server(launch, run.replay, {**inherited_environ(), **launch.env})
        if server is None or run.replay.seed is None:
            verdict: bool | str = "their fork server refused (see its note)"
        elif why := unplannable(server):
            verdict = why
        else:
            shares = plan_shares(server.received, server.items, run.replay.seed, run.shuffle,
                                 run.workers)  # fmt: skip
            why = plan_differs(shares, rows)
            verdict = f"{launch.label} (xdist) was not the plan: {why}" if why else True
        with self._count:
            self.run_plan = verdict

    def _left_out(self, replay: Replay) -> tuple[str, ...]:
        """The paths of the modules its server left out that the replay runs tests of: its
        child collects them itself, after the fork, where their import may initialise CUDA."""
        with self._count:
            paths = dict(self.unforkable_paths)
        if not paths:
            return ()
        wanted = {nodeid.split("::", 1)[0] for nodeid in order.read_replay(replay.replay_file)}
        return tuple(path for module, path in sorted(paths.items()) if module in wanted)

    def _counted(self, *, forked: int = 0, fresh: int = 0) -> None:
        with self._count:
            self.forked += forked
            self.fresh += fresh

    def _server(self, launch: Launch, replay: Replay, env: Mapping[str, str]) -> ForkServer | None:
        """The server for this launch's key, started on first use; None if it refused."""
        key = (str(launch.cwd), replay.server_args, tuple(sorted(launch.env.items())))
        with self._count:
            starting = self._starting.setdefault(key, threading.Lock())
            number = len(self._starting)  # its own directory, whichever key starts first
        with starting:
            if key in self._servers:
                known = self._servers[key]
                if known is None or known.alive:
                    return known
                with self._count:  # what would have forked runs fresh from now on: say why
                    if not self._closing:
                        self.refusals.setdefault(f"{launch.cwd} ({known.log.parent.name})",
                                                 f"it died (exit {known.proc.poll()}; see "
                                                 f"{known.log})")  # fmt: skip
                return None
            workdir = self.workdir / f"server-{number}"
            scratch = workdir / "tmp"  # the server's own CAPSAFE_SWEEP_TMP: each job sets its own
            scratch.mkdir(parents=True, exist_ok=True)
            server_env = {**env, SWEEP_TMP_ENV: str(scratch)}
            targets = list(self.targets)
            left_out: list[str] = []  # modules whose import initialises CUDA
            while True:
                ignored = [f"--ignore={path}" for path in left_out]
                args = [*targets, *replay.server_args, *ignored]
                try:
                    server = self._start(args, launch.cwd, server_env, workdir)
                except Refused as refused:
                    server = None
                    if refused.module and len(left_out) < MAX_LEFT_OUT:
                        with self._count:
                            self.unforkable[refused.module] = refused.reason
                            self.unforkable_paths[refused.module] = refused.path
                        left_out.append(refused.path)
                        # pytest's --ignore passes over a file given as a target: drop it there
                        targets = [t for t in targets if not _same_file(launch.cwd / t,
                                                                        refused.path)]  # fmt: skip
                        if targets:
                            continue  # serve the rest of the suite without it
                    with self._count:
                        if not self._closing:
                            self.refusals[f"{launch.cwd} ({workdir.name})"] = refused.reason
                break
            self._servers[key] = server
            return server

    def _start(
        self, args: Sequence[str], cwd: Path, env: Mapping[str, str], workdir: Path
    ) -> ForkServer:
        """A server launched and collected; Refused when it will not fork (or we close)."""
        with self._count:
            if self._closing:
                raise Refused("the sweep is closing")
            server = ForkServer.spawn(args, cwd, env, workdir)
            self._spawned.append(server)
        server.wait_ready(self.start_timeout)
        return server

    def notes(self) -> list[str]:
        """Lines for the report: how many replays forked, and why any server refused."""
        with self._count:
            lines = [f"fork server: {self.forked} replay(s) forked, {self.fresh} run fresh"]
            if self.runs_forked:
                lines.append(f"fork server: {self.runs_forked} suite run(s) forked, a child "
                             "per xdist worker, once an xdist run matched their plan")  # fmt: skip
            elif isinstance(self.run_plan, str):
                lines.append(f"fork server: suite runs ran under xdist: {self.run_plan}")
            if self.undecided:
                lines.append(f"fork server: {', '.join(self.undecided)} could not show that "
                             "xdist runs the plan, so the next suite run (if any) ran "
                             "under xdist too")  # fmt: skip
            lines += [f"fork server: {module} initialises CUDA at import ({why}); the server "
                      "leaves it out and each child that runs its tests collects it"
                      for module, why in sorted(self.unforkable.items())]  # fmt: skip
            lines += [f"fork server refused ({where}): {why}" for where, why in
                      sorted(self.refusals.items())]  # fmt: skip
            if self.crashed:
                lines.append(f"fork server: {len(self.crashed)} forked child(ren) ended by a "
                             f"signal ran again fresh, and only the fresh run counts: "
                             f"{', '.join(sorted(self.crashed))}")  # fmt: skip
        return lines

    def close(self) -> None:
        """Stop every server (their running children are killed first)."""
        with self._count:
            self._closing = True  # a server launched from now on is not
            servers = list(self._spawned)
        for server in servers:  # also one still collecting (a prestart): it is killed
            server.close()


def _unclean(end: Exit, rows: Sequence[Record]) -> str:
    """Why an xdist run cannot show whether its split is the plan; "" when it can."""
    if end.stalled:
        return "stalled"
    if end.lost:
        return f"lost: {end.lost}"
    if end.returncode not in (0, 1):
        return f"pytest exited {end.returncode}"
    if any(Signal.CRASH in row["signals"] for row in rows):
        return "a worker crashed, and its replacement restarts its count"
    return ""


def _same_file(target: Path, path: str) -> bool:
    try:
        return target.resolve() == Path(path).resolve()
    except OSError:
        return False
