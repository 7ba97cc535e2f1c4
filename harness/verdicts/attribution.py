"""Hazard attribution: which neighbour call kinds break a capture-unsafe test.

Group testing over the call kinds the neighbours make. The hazard table says
which kinds behave alike (they fall under the same rules: the allocator calls,
the legacy-stream work, the calls that break every capture), so the first round
runs one process per such group, and only a group that broke a test is split
into its single kinds in the second round. A mode the table says is untouched by
a group costs one process for the whole group instead of one per kind. Every
process of a round runs all the tests still undecided on its kinds, so the cost
is per kind group, not per test, and the processes of a round run in parallel.

A neighbour's call breaks a capture only when it lands inside the capture's
window, which is a matter of chance (on the H200, ctx_sync neighbours broke 10
of 12 CuPy graph tests in one process): a test no kind broke once every process
of a round has reported gets the first-round groups again, all such tests in
the same processes, up to ROUNDS rounds (the sweep runs each test more times in each
later round: capture_sweep.ATTRIBUTION_REPEATS). A break is conclusive, so a test that
broke is never retried.

From the kinds that broke a test and those it survived, the hazard table
narrows down the mode and stream kind it captured in; `advice` turns that into
what to do about it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from capsafe import hazards
from capsafe.handles import CaptureMode, StreamKind
from capsafe.hazards.actions import BY_NAME

Subset = tuple[str, ...]
#: One process: neighbours restricted to `kinds`, running `tests`.
Job = tuple[Subset, tuple[str, ...]]
#: Per test: True broke (failed with a capture error), False survived, None no evidence.
Outcomes = dict[str, bool | None]
ROUNDS = 3  # group-testing rounds a test no kind broke gets (see the module doc)


def kind_groups(kinds: Sequence[str]) -> list[Subset]:
    """`kinds` grouped by the hazard-table rules their rows fall under, in table order
    (the rules about active captures: which calls break one)."""
    groups: dict[frozenset[str], list[str]] = {}
    for kind in kinds:
        row = BY_NAME[kind].row
        rules = frozenset(
            r.name for r in hazards.RULES if row in r.calls and hazards.ACTIVE in r.states
        )
        groups.setdefault(rules, []).append(kind)
    return [tuple(members) for members in groups.values()]


@dataclass
class Attribution:
    """One test's verdict per call kind."""

    breaks: list[str] = field(default_factory=list)
    survives: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)  # no process gave evidence on them

    def to_dict(self) -> dict[str, list[str]]:
        return {"breaks": self.breaks, "survives": self.survives, "undecided": self.undecided}


class GroupTest:
    """The group testing of a set of tests (see the module doc). `start()` gives the first
    processes; `record()` of each finished one gives the processes it calls for next, so
    a caller may run them as soon as they are known (thread-safe)."""

    def __init__(self, tests: Iterable[str], kinds: Sequence[str]) -> None:
        self.kinds = tuple(kinds)
        self.tests = tuple(tests)
        self.breaks: dict[str, set[str]] = {t: set() for t in self.tests}
        self.survives: dict[str, set[str]] = {t: set() for t in self.tests}
        self.processes = 0
        self.rounds = 0
        self._pending = 0  # processes of the current round not yet recorded
        self._lock = threading.Lock()

    def start(self) -> list[Job]:
        with self._lock:
            return self._round(self.tests)

    def _round(self, tests: Sequence[str]) -> list[Job]:
        if not tests:
            return []
        self.rounds += 1
        return self._count([(g, tuple(tests)) for g in kind_groups(self.kinds)])

    def _count(self, jobs: list[Job]) -> list[Job]:
        self.processes += len(jobs)
        self._pending += len(jobs)
        return jobs

    def record(self, kinds: Subset, outcomes: Outcomes) -> list[Job]:
        """What one process showed; returns the processes that follow: the single kinds of
        a group that broke a test, or, when the round is over, the next round for the tests
        no kind broke."""
        split: list[str] = []
        with self._lock:
            self._pending -= 1
            for test, broke in outcomes.items():
                if broke is None or test not in self.breaks:
                    continue
                if not broke:
                    self.survives[test].update(kinds)
                elif len(kinds) == 1:
                    self.breaks[test].update(kinds)
                else:
                    split.append(test)
            jobs = self._count([((kind,), tuple(split)) for kind in kinds] if split else [])
            if self._pending or self.rounds >= ROUNDS:
                return jobs
            return self._round([t for t in self.tests if not self.breaks[t]])

    def result(self, test: str) -> Attribution:
        breaks, survives = self.breaks[test], self.survives[test] - self.breaks[test]
        return Attribution(
            breaks=[k for k in self.kinds if k in breaks],
            survives=[k for k in self.kinds if k in survives],
            undecided=[k for k in self.kinds if k not in breaks | survives],
        )


def attribute(
    tests: Sequence[str],
    kinds: Sequence[str],
    run_round: Callable[[list[Job]], Iterable[tuple[Subset, Outcomes]]],
) -> tuple[dict[str, Attribution], int]:
    """Attribute every test in rounds; `run_round` runs a round's jobs and yields (kinds,
    outcomes) per finished job. Returns the attributions and the process count."""
    group = GroupTest(tests, kinds)
    jobs = group.start()
    while jobs:
        jobs = [
            new for subset, outcomes in run_round(jobs) for new in group.record(subset, outcomes)
        ]
    return {t: group.result(t) for t in tests}, group.processes


def consistent_cells(attribution: Attribution) -> list[tuple[CaptureMode, StreamKind]]:
    """(mode, capture stream kind) cells where another thread's calls break exactly as seen."""
    cells = []
    for mode in hazards.MODES:
        for stream in hazards.CAPTURE_STREAMS:

            def breaks(kind: str, mode: CaptureMode = mode, stream: StreamKind = stream) -> bool:
                rule = hazards.rule_for(BY_NAME[kind].row, mode, stream, hazards.OTHER_THREAD)
                return rule is not None

            if all(breaks(k) for k in attribution.breaks) and not any(
                breaks(k) for k in attribution.survives
            ):
                cells.append((mode, stream))
    return cells


def describe(attribution: Attribution) -> str:
    """`breaks under: ctx_sync, memset_sync; survives: mem_alloc` (kinds undecided last)."""
    parts = [
        f"breaks under: {', '.join(attribution.breaks) or 'no single call kind'}",
        f"survives: {', '.join(attribution.survives) or 'none'}",
    ]
    if attribution.undecided:
        parts.append(f"not decided: {', '.join(attribution.undecided)}")
    return "; ".join(parts)


def advice(attribution: Attribution) -> str:
    """What the hazard table says follows from the kinds that broke the test: the mode it
    captured in, the calls to keep out of its window, and the fix."""
    fix = (
        "or take the capture through `capsafe.capture` (for CuPy and cuda.core captures: run "
        "with `--capsafe-protect=cupy,cuda_core`): its gate holds other threads' "
        "capture-breaking calls made through capsafe off for the window, so it survives "
        "these neighbours"
    )
    if not attribution.breaks:
        return (
            "no single call kind broke it, only several at once: keep every capture-breaking "
            f"call of other threads out of its capture window, {fix}"
        )
    cells = consistent_cells(attribution)
    others = _symbols(BY_NAME[k].row for k in attribution.breaks)
    if not cells:
        return (
            f"no capture mode of the hazard table breaks exactly like this; other threads must "
            f"keep {others} out of the capture window, {fix}"
        )
    modes = " or ".join(sorted({m.value.upper() for m, _ in cells}))
    streams = " or ".join(sorted({s.value for _, s in cells}))
    own = []
    for mode in sorted({m for m, _ in cells}):
        rows = [c for c in hazards.CALLS if _extra_on_own_thread(c, mode, cells)]
        if rows:
            own.append(f"; on its own thread {mode.value.upper()} also refuses {_symbols(rows)}")
    return (
        f"captured in {modes} mode on a {streams} stream (inferred from the hazard table): "
        f"other threads must keep {others} out of the capture window{''.join(own)}; {fix}"
    )


def _extra_on_own_thread(
    call: str, mode: CaptureMode, cells: list[tuple[CaptureMode, StreamKind]]
) -> bool:
    """`call` breaks a `mode` capture from the capturing thread but not from another one."""
    return any(
        hazards.rule_for(call, mode, s, hazards.SAME_THREAD)
        and not hazards.rule_for(call, mode, s, hazards.OTHER_THREAD)
        for m, s in cells
        if m is mode
    )


def _symbols(rows: Iterable[str]) -> str:
    return ", ".join(dict.fromkeys(hazards.CALLS[row] for row in rows))
