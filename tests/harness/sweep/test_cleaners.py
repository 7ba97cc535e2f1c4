"""The cleaner search (issue 25) over a model of shared state: which tests clean a victim,
found by group testing, verified K times, capped, within the budget."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from capsafe_harness.fix.case import FixCase
from capsafe_harness.sweep.cleaners import CleanerSearch, find_cleaners, groups
from capsafe_harness.sweep.fixes import Fixes
from capsafe_harness.sweep.host import Replayed
from capsafe_harness.sweep.journal import Journal
from capsafe_harness.sweep.store import EvidenceStore
from capsafe_harness.verdicts.fold import Attempt

P, V = "tests/test_p.py::test_pollute", "tests/test_v.py::test_victim"
CLEAN = ["tests/test_c.py::test_reset", "tests/test_z.py::test_reset_too"]
REPOLLUTE = "tests/test_c.py::test_pollute_again"  # after a cleaner, pollutes once more
PADS = [f"tests/test_pad{m}.py::test_{i}" for m in range(4) for i in range(30)]


class StateHost:
    """Replays through a model: P and REPOLLUTE pollute, CLEAN restore, V fails polluted."""

    def __init__(self, cleaners: Sequence[str] = CLEAN, budget: int = 10_000) -> None:
        self.cleaners = set(cleaners)
        self.asked: list[tuple[str, bool, tuple[str, ...]]] = []
        self.budget = budget

    def replay(
        self, sequence: Sequence[str], *, seed: int | None, kind: str,
        extra: Sequence[str] = (), exclusive: bool = False, group: object = None,
    ) -> Replayed:  # fmt: skip
        self.asked.append((kind, exclusive, tuple(sequence)))
        polluted = False
        found = {}
        for i, test in enumerate(sequence):
            failed = test == V and polluted
            found[test] = Attempt(test, "r", failed, frozenset(), "main", 1, i, 0.0, 1, "")
            polluted = (polluted or test in (P, REPOLLUTE)) and test not in self.cleaners
        return Replayed(f"{kind}-{len(self.asked)}", found, 0, True, Path("log"))

    def only(self) -> AbstractContextManager[object]:
        return nullcontext(object())

    def pool(self, desc: str, jobs: Sequence[Any], work: Any, target: Any = None) -> None:
        raise AssertionError("the cleaner search runs in its caller's job")

    def budget_left(self) -> bool:
        return len(self.asked) < self.budget

    def note(self, text: str) -> None:
        pass


def test_every_cleaner_is_found_and_verified_k_times() -> None:
    host = StateHost()
    found = find_cleaners(host, V, [P], [*PADS, *CLEAN, V, P], times=3)
    assert found.cleaners == tuple(CLEAN)
    assert found.candidates == len(PADS) + 2
    verifications = [s for kind, excl, s in host.asked if kind == "verify-cleaner"]
    assert verifications == [(P, c, V) for c in CLEAN for _ in range(3)]
    assert all(excl for kind, excl, _ in host.asked if kind == "verify-cleaner")
    assert found.verification_replays == 6
    # group testing, not a replay per test: far fewer replays than candidates
    assert found.replays < len(PADS) // 4


def test_a_suite_without_cleaners_costs_one_replay_per_group() -> None:
    host = StateHost(cleaners=())
    found = find_cleaners(host, V, [P], PADS, times=3, size=50)
    assert found.cleaners == ()
    assert found.replays == len(groups(PADS, [V, P], 50)) == 3


def test_the_cap_stops_the_search() -> None:
    many = [f"tests/test_c.py::test_reset_{i}" for i in range(6)]
    found = find_cleaners(StateHost(cleaners=many), V, [P], [*many, *PADS], times=1, cap=2)
    assert found.cleaners == tuple(many[:2])


def test_a_group_that_re_pollutes_after_its_cleaner_hides_it() -> None:
    """The victim still fails with the group between: no claim is made about it."""
    found = find_cleaners(StateHost(), V, [P], [CLEAN[0], REPOLLUTE], times=1)
    assert found.cleaners == ()


def test_the_budget_ends_the_search_with_what_was_verified() -> None:
    host = StateHost(budget=12)
    found = find_cleaners(host, V, [P], [*CLEAN, *PADS], times=3)
    assert found.budget_cut
    assert len(host.asked) == 12
    assert set(found.cleaners) <= set(CLEAN)


def test_groups_keep_modules_together_nearest_first() -> None:
    tests = ["a/test_x.py::t1", "b/test_v.py::t2", "a/test_x.py::t3", "c/test_p.py::t4"]
    assert groups(tests, ["b/test_v.py::v", "c/test_p.py::p"], 3) == [
        ["b/test_v.py::t2", "c/test_p.py::t4", "a/test_x.py::t1"], ["a/test_x.py::t3"],
    ]  # fmt: skip


def test_a_search_round_trips_through_the_journal() -> None:
    found = CleanerSearch(V, 9, tuple(CLEAN), 7, 6, True)
    assert CleanerSearch.from_dict(found.to_dict()) == found


class FixingHost(StateHost):
    """StateHost with what the fixing phase asks besides: its pool, and scratch replays."""

    def pool(self, desc: str, jobs: Sequence[Any], work: Any, target: Any = None) -> None:
        queue = list(jobs)
        while queue:
            queue += work(queue.pop(0), 0)

    def replay_in(self, root: Path, sequence: Sequence[str]) -> dict[str, bool | None]:
        raise AssertionError("the stand-in engine replays nothing")


def test_a_known_polluter_is_asked_alone_and_may_be_a_cleaner() -> None:
    """A test that sets a mode pollutes the tests expecting the other, and may clean V."""
    both = "tests/test_c.py::test_pollutes_others_cleans_v"
    host = StateHost(cleaners=[both])
    found = find_cleaners(host, V, [P], [*PADS, both, REPOLLUTE], times=1,
                          alone=[both, REPOLLUTE])  # fmt: skip
    assert found.cleaners == (both,)
    asked = [sequence for kind, _, sequence in host.asked if kind == "cleaner"]
    assert asked[:2] == [(P, both, V), (P, REPOLLUTE, V)]  # each alone, before any group


def test_the_phase_asks_known_polluters_alone(tmp_path: Path) -> None:
    """REPOLLUTE, a verified polluter of another test, would follow the cleaner in its
    module's group and hide it; the fixing phase asks every known polluter alone."""
    store = EvidenceStore(tmp_path, 60.0)
    store.collected = (CLEAN[0], REPOLLUTE, V, P)
    ev = store.ev(V)
    ev.runs, ev.failures, ev.isolation_runs, ev.polluters = 4, 2, 3, [P]
    store.causes += [("polluter", (P,)), ("polluter", (REPOLLUTE,))]
    cases: list[FixCase] = []

    def engine(case: FixCase, *args: Any, **kwargs: Any) -> None:
        cases.append(case)

    fixes = Fixes(FixingHost(), store, Journal(tmp_path, resume=False), lambda: tmp_path,
                  tmp_path / "out", tmp_path, find_patch=engine)  # fmt: skip
    fixes.run()
    assert [c.cleaners for c in cases] == [(CLEAN[0],)]
    assert cases[0].collected == store.collected  # the engine's module check replays these
    assert store.ev(V).cleaners == [CLEAN[0]]
    assert fixes.records[V].outcome == "no patch verified"
    # asked again in a resumed sweep: served from the journal, no replay
    again = Fixes(FixingHost(cleaners=()), store, Journal(tmp_path, resume=True),
                  lambda: tmp_path, tmp_path / "out", tmp_path, find_patch=engine)  # fmt: skip
    again.run()
    assert again.records == fixes.records and len(cases) == 1
