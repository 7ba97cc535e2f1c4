"""Which of the sweep's command lines a fork server can serve, and what its jobs set.

A command is split into the options a job sets for itself (fork_server.JOB_OPTIONS:
records directory, run id, replay list, seed, neighbour threads, integrations) and the
rest, which (with the suite's own targets) is the server's command line. Two kinds split:
a single-process replay (`--capsafe-replay=FILE` with `-n=0` or `-p no:xdist`), and a
suite run (`--capsafe-shuffle=MODE -n=W`), whose rest, with `-n=0` for `-n=W`, is a
replay's: one server serves both.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..plugin import protect
from .fork_server import JOB_OPTIONS

__all__ = ["IN_PROCESS", "NO_XDIST", "PYTEST", "Replay", "SuiteRun", "split_replay", "split_run"]

PYTEST = ("-m", "pytest")
NO_XDIST = ("-p", "no:xdist")
IN_PROCESS = "-n=0"
"""How a replay runs in one process: xdist loaded and idle (`-n=0`) where the suite runs use
xdist, so the fixtures it gives (`worker_id`, `testrun_uid`) exist as they did in the runs
(left out, a test using one errored in every replay: a false `flaky`); xdist left out
(NO_XDIST) where the runs use none (a suite whose addopts disable it)."""
SHUFFLE = "--capsafe-shuffle"
WORKERS = "-n"
GPUS = "--capsafe-gpus"
REQUIRED = {"--capsafe-records", "--capsafe-run-id"}  # the seed may be absent


@dataclass(frozen=True)
class Replay:
    """A command line, split: what the server runs, what the job sets."""

    server_args: tuple[str, ...]  # the pytest arguments after the targets, minus JOB_OPTIONS
    records: str
    run_id: str
    replay_file: str  # "" for a suite run
    seed: int | None
    neighbors: int = 0
    neighbor_calls: str | None = None
    protect: str | None = None
    watch_env: str | None = None


@dataclass(frozen=True)
class SuiteRun:
    """A suite run's command line, split: the job options its shares set, the run's order."""

    replay: Replay  # server_args with `-n=0` for the run's `-n=W`: a replay's server
    workers: int
    shuffle: str


def _split(args: list[str]) -> Replay | None:
    """`args` (the command after `python -m pytest TARGETS`) as server and job options;
    None without the options every job needs."""
    job: dict[str, str] = {}
    rest: list[str] = []
    for arg in args:
        name, _, value = arg.partition("=")
        if name in JOB_OPTIONS and value:
            job[name] = value  # the last one wins, as in pytest
        else:
            rest.append(arg)
    if not set(job) >= REQUIRED:
        return None
    seed = job.get("--capsafe-seed")
    return Replay(
        server_args=tuple(rest),
        records=job["--capsafe-records"],
        run_id=job["--capsafe-run-id"],
        replay_file=job.get("--capsafe-replay", ""),
        seed=None if seed is None else int(seed),
        neighbors=int(job.get("--capsafe-neighbors", "0")),
        neighbor_calls=job.get("--capsafe-neighbor-calls"),
        protect=job.get(protect.OPTION),
        watch_env=job.get("--capsafe-watch-env"),
    )


def _arguments(cmd: Sequence[str]) -> list[str] | None:
    """The options of a `python -m pytest TARGETS OPTIONS` command (its files dropped: the
    server collects the suite's own targets); None for any other command."""
    if tuple(cmd[1:3]) != PYTEST:
        return None
    args = list(cmd[3:])
    while args and not args[0].startswith("-"):
        args.pop(0)
    return args


def split_replay(cmd: Sequence[str]) -> Replay | None:
    """The split of a single-process replay command (`python -m pytest TARGETS ...
    --capsafe-replay=FILE ... -n=0 ...`, or `-p no:xdist`); None for any other command."""
    args = _arguments(cmd)
    if args is None:
        return None
    if NO_XDIST not in set(itertools.pairwise(args)) and IN_PROCESS not in args:
        return None
    replay = _split(args)
    return replay if replay is not None and replay.replay_file else None


def split_run(cmd: Sequence[str]) -> SuiteRun | None:
    """The split of a suite run's command (`python -m pytest TARGETS ...
    --capsafe-shuffle=MODE --capsafe-seed=S -n=W ...`, W > 0); None for any other command,
    and for one pinned to GPUs (each worker is pinned to its own device)."""
    args = _arguments(cmd)
    if args is None or any(a.startswith((GPUS, "--capsafe-replay")) for a in args):
        return None
    shuffles = [a for a in args if a.startswith(f"{SHUFFLE}=")]
    workers = [a for a in args if a.startswith(f"{WORKERS}=")]
    if len(shuffles) != 1 or len(workers) != 1 or not workers[0][3:].isdigit():
        return None
    count = int(workers[0][3:])
    rest = [IN_PROCESS if a == workers[0] else a for a in args if a != shuffles[0]]
    replay = _split(rest)
    if count < 1 or replay is None or replay.seed is None:
        return None
    return SuiteRun(replay, count, shuffles[0].partition("=")[2])
