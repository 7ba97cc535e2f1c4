"""What `capsafe sweep` was asked to do, and the one error type for a sweep that cannot run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .shard import Shard


class SweepError(Exception):
    """The sweep cannot start or the suite cannot be run at all: a usage error (exit 2)."""


@dataclass(frozen=True)
class SweepOptions:
    """Everything `capsafe sweep` was asked to do. Paths are absolute."""

    paths: tuple[Path, ...]
    out: Path
    seed: int
    runs: int = 5
    workers: int = 2
    jobs: int | None = None  # --jobs: test processes a phase runs at once; None: pool_width's
    timeout: float = 60.0
    isolation_runs: int = 3
    neighbors: int = 0
    threads: int = 1
    budget: float | None = None
    phase_budget: float | None = None  # seconds for each phase after the runs; None: auto
    baseline: frozenset[str] = frozenset()
    pytest_args: tuple[str, ...] = ()
    stall_s: float | None = None  # None: 2 x timeout + 30 s
    progress: bool = True
    invoked_from: Path | None = None  # where `capsafe sweep` ran; None: the current directory
    resume: bool = False  # continue the sweep already in `out` (same seed and options)
    force: bool = False  # start over in an `out` that holds a sweep
    executor: str = "local"  # where processes run: "local" or "ray" (harness.sweep.executor)
    address: str | None = None  # --executor ray: the cluster (None: start or join a local one)
    gpus: tuple[str, ...] = ()  # --gpus, resolved to device ids: one per process, round-robin
    protect: str = "auto"  # --protect: auto, none, or integration names (capture_sweep)
    shard: Shard | None = None  # this sweep is shard K of N (harness.sweep.shard): no searches
    junitxml: Path | None = None  # --junitxml: the verdicts as JUnit XML (harness.report.junit)
    fork: bool = True  # replays forked from one collected pytest (fork_executor); False: fresh
    fix: bool = False  # --fix: the fixing phase (harness.sweep.fixes) after the searches

    @property
    def stall_limit(self) -> float:
        return self.stall_s if self.stall_s is not None else 2 * self.timeout + 30

    def identity(self) -> dict[str, object]:
        """The options a resumed sweep must share with the one it continues."""
        return dict(  # keywords: these are the options' names
            paths=[str(p) for p in self.paths],
            seed=self.seed,
            runs=self.runs,
            workers=self.workers,
            timeout=self.timeout,
            isolation_runs=self.isolation_runs,
            neighbors=self.neighbors,
            threads=self.threads,
            pytest_args=list(self.pytest_args),
            shard=None if self.shard is None else str(self.shard),
        )
