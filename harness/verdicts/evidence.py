"""What the sweep learned about one test across all its processes: its `Evidence`.

The sweep's phases fill one store of `Evidence`, one per test (runs, reruns alone,
searches, verification, and the capture phases' `CaptureEvidence` inside it); the
catalogue's rules read it and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VERIFY_TIMES = 3  # K: a cause is reported only when it reproduces K times, and K times not without


@dataclass
class CaptureEvidence:
    """One test's runs split by neighbours: capture failures with, and the control without.

    A capture failure is a failure raised inside one of the test's own capture windows (the
    plugin's failed-in-capture signal), whatever the library called it. Control runs alone
    decide. A batched control run is evidence only when it passed; one that failed sends
    the test to alone reruns, and from then on only those decide.
    """

    neighbor_runs: int = 0
    neighbor_failures: int = 0  # any failure, with neighbours
    capture_failures: int = 0  # of those, raised inside a capture window of its own
    control_runs: int = 0  # alone, without neighbours
    control_failures: int = 0
    batch_control_passes: int = 0
    batch_control_failures: int = 0

    @property
    def suspect(self) -> bool:
        return self.capture_failures > 0

    @property
    def capture_unsafe(self) -> bool:
        if not self.suspect or self.control_failures:
            return False
        if self.batch_control_failures:
            return self.control_runs > 0
        return self.control_runs + self.batch_control_passes > 0

    @property
    def passed_without_neighbors(self) -> bool:
        """Every run without neighbours passed, and there was at least one."""
        if self.control_failures or self.batch_control_failures:
            return False
        return self.control_runs + self.batch_control_passes > 0

    @property
    def neighbour_sensitive(self) -> bool:
        """Failed only beside neighbour threads, never inside a capture of its own."""
        return (self.neighbor_failures > 0 and self.capture_failures == 0
                and self.passed_without_neighbors)  # fmt: skip


@dataclass
class Evidence:
    """What the sweep learned about one test, filled in phase by phase.

    `polluters` and `state_setters` hold only causes verified K times; a cause a
    search found that did not verify is kept in `unconfirmed`.
    """

    nodeid: str
    runs: int = 0
    failures: int = 0
    isolation_runs: int = 0
    isolation_failures: int = 0
    polluters: list[str] = field(default_factory=list)
    state_setters: list[str] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)
    cleaners: list[str] = field(default_factory=list)  # run between polluter and it: it passes
    concurrent: list[str] = field(default_factory=list)  # set only when parallel-unsafe holds
    collides_with: list[str] = field(default_factory=list)  # of `concurrent`: confirmed K times
    collect_error: str | None = None
    capture: CaptureEvidence = field(default_factory=CaptureEvidence)  # the capture phases'
    budget_cut: bool = False  # --budget stopped a rerun, search or verification it needed
    signals: set[str] = field(default_factory=set)
    message: str = ""
    capture_sites: list[str] = field(default_factory=list)  # where it began captures (file:line)
    capture_frameworks: set[str] = field(default_factory=set)  # what those captures went through
    leak_failures: int = 0  # failed with a capture error, having begun no capture (fold.Attempt)
    other_failures: int = 0  # failures of the same attempts (runs, batches) of any other kind
    thread_unsafe: str | None = None  # pytest-run-parallel's thread_unsafe marker's reason

    @property
    def leak_victim(self) -> bool:
        """It failed with a capture error before any capture of its own in that process, and
        never inside one: a capture another test left open there is what it ran into. A
        test that captures in its other runs is one only when every failure was such
        (CuPy's fork-join graph test failed so once in four neighbour runs on the H200, and
        was reported with no cause); with failures of another kind too, its cause is
        searched for as any test's (one open capture must not hide a polluter)."""
        if self.leak_failures == 0 or self.capture_unsafe:
            return False
        return not self.capture_sites or self.other_failures == 0

    @property
    def neighbour_sensitive(self) -> bool:
        """Failed only beside neighbour threads and never inside its own capture. A leak
        victim whose leaker was confirmed is `order-dependent` first (the catalogue's order);
        one whose leaker no replay confirmed stays here, never `flaky`: the capture it ran
        into was left open only because neighbours broke it."""
        return self.capture.neighbour_sensitive

    @property
    def capture_unsafe(self) -> bool:
        return self.capture.capture_unsafe

    @property
    def ran(self) -> bool:
        return self.runs > 0 or self.isolation_runs > 0

    @property
    def ever_failed_alone(self) -> bool:
        return self.isolation_failures > 0

    @property
    def always_failed_alone(self) -> bool:
        return self.isolation_runs > 0 and self.isolation_failures == self.isolation_runs

    @property
    def failed_alone_only_beside_neighbours(self) -> bool:
        """A leak victim that failed alone only in the reruns with neighbour threads: those
        failures read state the threads change (a pool's byte count), and say nothing
        against the capture another test left open, which alone there is none of."""
        return (self.ever_failed_alone and self.leak_victim
                and self.capture.passed_without_neighbors)  # fmt: skip
