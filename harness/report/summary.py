"""The sweep's result as typed objects; `to_dict` is exactly what summary.json holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class TestVerdict:
    """One test's class and the numbers behind it."""

    __test__ = False  # not a pytest test class, whatever its name

    nodeid: str
    classification: str
    why: str  # the evidence in words, agreeing with the numbers beside it
    runs: int
    failures: int
    flake_rate: float
    flake_rate_ci: tuple[float, float]
    detection_chance: float | None  # chance a sweep of this many runs shows it; None: pass
    isolation_runs: int
    isolation_failures: int
    polluters: list[str]
    state_setters: list[str]
    unconfirmed: list[str]  # a cause a search found that did not verify K times
    concurrent: list[str]  # parallel-unsafe: the tests that ran at the same time elsewhere
    signals: list[str]
    message: str  # the first lines of a failure (or pytest's collection error)
    replay: str
    capture: dict[str, Any] | None = None  # capture-unsafe: harness.sweep.capture_sweep's fields
    collides_with: list[str] = field(default_factory=list)  # parallel-unsafe, confirmed K times
    cleaners: list[str] = field(default_factory=list)  # order-dependent: verified K times (--fix)
    # a verified patch (--fix): path, diff, how, source, patch (its file in --out), apply
    fix: dict[str, Any] | None = None


@dataclass(frozen=True)
class SearchRecord:
    """One cause search: its replays, and apart from them the verification replays."""

    victim: str
    kind: str  # "polluter", "state-setter", "trial" (a known cause tried on another test)
    candidates: int
    replays: int
    verification_replays: int
    culprits: list[str]
    verified: bool
    capped: bool  # ddmin stopped at its cap


@dataclass(frozen=True)
class FixRecord:
    """One verdict the fixing phase (--fix) worked on: its cleaner search and its patch."""

    victim: str
    kind: str  # order-dependent or brittle
    cleaners: list[str]
    cleaner_replays: int  # the cleaner search's replays, its verification included
    patched: bool  # a verified patch was found
    outcome: str  # the patch's "how", or why there is none


@dataclass
class Summary:
    """The whole sweep: what ran, every test's verdict, every search, and the notes."""

    runs: int
    workers: int
    seeds: list[int]
    shuffles: list[str]
    backend: str
    duration_s: float
    tests: list[TestVerdict]
    counts: dict[str, int]
    searches: list[SearchRecord]
    notes: list[str] = field(default_factory=list)
    ddmin_cap: int = 0
    verify_times: int = 0
    phase_times: dict[str, Any] = field(default_factory=dict)  # harness.plugin.phase_times
    gpu: dict[str, Any] = field(default_factory=dict)  # harness.report.gpu_report
    shard: str = ""  # "K/N" for a shard's partial view (harness.sweep.shard); "" otherwise
    # suite runs pytest failed with every test passing: run_id, returncode, message, log
    suite_errors: list[dict[str, Any]] = field(default_factory=list)
    # failures by GPU (report.placement), only when some test process was pinned to one
    placement: dict[str, Any] | None = None
    # the per-test timeout the test processes ran under and whose it was (the project's own
    # pytest-timeout setting wins over --timeout)
    timeout: str = ""
    # a sweep stopped by a signal: by what, in which phase, and how much ran ("": it finished)
    interrupted: str = ""
    # tests classed pass that were skipped, xfailed or xpassed, by that outcome: never
    # counted as a pass in the headline, the cards, the console or JUnit
    outcomes: dict[str, int] = field(default_factory=dict)
    # the fixing phase's work, one per verdict it tried to fix (empty without --fix)
    fixes: list[FixRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """summary.json's content (no `placement` key when no process was pinned). A
        verdict's fields hold no dataclass, so each is copied flat: `asdict`'s deep copy of
        every list and dict took 0.4 s at 2,000 tests, for a dump."""
        data = asdict(replace(self, tests=[]))
        data["tests"] = [dict(vars(t)) for t in self.tests]
        if data["placement"] is None:
            del data["placement"]
        return data
