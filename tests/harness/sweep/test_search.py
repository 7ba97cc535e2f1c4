"""The cause search: replay counts for one polluter, delta debugging for several, hints, the cap.

Verification (K replays each way) is the sweep's, not the search's: test_sweep_evidence.py."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest

from capsafe_harness.fix.delta import bisect, capped_ddmin, ddmin
from capsafe_harness.sweep.search import CountingOracle, grouped, search


def needs(
    *culprits: str, log: list[tuple[str, ...]] | None = None
) -> Callable[[Sequence[str]], bool]:
    """A fake replay oracle: the target misbehaves when every culprit ran before it."""

    def oracle(tests: Sequence[str]) -> bool:
        if log is not None:
            log.append(tuple(tests))
        return set(culprits) <= set(tests)

    return oracle


def names(n: int) -> list[str]:
    return [f"t.py::test_{i}" for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 100, 257, 1000])
def test_single_polluter_within_log2_plus_2_replays_wherever_it_is(n: int) -> None:
    candidates = names(n)
    for position in {0, n // 3, n // 2, n - 1}:
        polluter = candidates[position]
        result = search("t.py::victim", candidates, needs(polluter))
        assert result.culprits == (polluter,)
        assert result.reproduced and not result.capped
        assert result.candidates == n
        assert result.replays <= math.ceil(math.log2(n)) + 2


def test_first_replay_is_the_whole_prefix() -> None:
    log: list[tuple[str, ...]] = []
    candidates = names(10)
    search("v", candidates, needs(candidates[7], log=log))
    assert log[0] == tuple(candidates)


def test_pair_of_polluters_needed_together_is_found_by_ddmin() -> None:
    candidates = names(40)
    pair = (candidates[3], candidates[31])  # one in each half: bisection alone cannot
    result = search("v", candidates, needs(*pair))
    assert result.culprits == pair
    assert not result.capped


def test_three_polluters_needed_together() -> None:
    candidates = names(30)
    trio = (candidates[2], candidates[11], candidates[29])
    assert search("v", candidates, needs(*trio)).culprits == trio


def test_nothing_reproduces_means_no_culprit_and_one_replay() -> None:
    result = search("v", names(16), lambda tests: False)
    assert result.culprits == ()
    assert not result.reproduced
    assert result.replays == 1


def test_a_known_cause_is_asked_first_and_ends_the_search() -> None:
    log: list[tuple[str, ...]] = []
    candidates = names(64)
    pair = (candidates[5], candidates[50])
    result = search("v", candidates, needs(*pair, log=log), hints=[("x",), pair])
    assert result.culprits == pair and result.replays == 4  # and each half alone: no
    assert log[:2] == [("x",), pair] and sorted(log[2:]) == [(pair[0],), (pair[1],)]


def test_a_known_cause_of_several_tests_is_cut_to_what_this_victim_needs() -> None:
    # freezegun, seed 4: a victim of test_should_not_skip_cpython alone was named with the
    # pair another victim needs, which reproduced but was not minimal.
    candidates = names(64)
    pair = (candidates[5], candidates[50])
    result = search("v", candidates, needs(candidates[5]), hints=[pair])
    assert result.culprits == (candidates[5],) and result.reproduced


def test_ddmin_stops_at_its_cap_and_says_so() -> None:
    candidates = names(112)
    trio = (candidates[1], candidates[60], candidates[111])
    found, capped = capped_ddmin(candidates, needs(*trio), cap=10)
    assert capped and set(trio) <= set(found)
    result = search("v", candidates, needs(*trio), ddmin_cap=10)
    assert result.capped and result.replays <= 1 + math.ceil(math.log2(112)) + 1 + 10
    assert capped_ddmin(candidates, needs(*trio), cap=1000) == (list(trio), False)


def test_grouped_keeps_modules_and_classes_together_and_the_target_module_last() -> None:
    ids = ["b.py::t1", "a.py::C::x", "b.py::t2", "a.py::y", "a.py::C::z", "c.py::k"]
    assert grouped(ids, "a.py") == [
        "b.py::t1",
        "b.py::t2",
        "c.py::k",
        "a.py::C::x",
        "a.py::C::z",
        "a.py::y",
    ]


def test_state_setter_for_a_brittle_test() -> None:
    # Oracle for a brittle test: "it passes" after the setter ran first.
    candidates = names(20)
    setter = candidates[13]
    result = search("brittle", candidates, needs(setter))
    assert result.culprits == (setter,)


def test_empty_prefix_asks_nothing() -> None:
    result = search("v", [], needs("x"))
    assert result.replays == 0 and result.culprits == ()


def test_target_is_never_its_own_candidate() -> None:
    log: list[tuple[str, ...]] = []
    search("v", ["a", "v", "b"], needs("b", log=log))
    assert all("v" not in replay for replay in log)


def test_counting_oracle_asks_each_question_once() -> None:
    calls: list[Sequence[str]] = []

    def oracle(tests: Sequence[str]) -> bool:
        calls.append(tests)
        return True

    ask = CountingOracle(oracle)
    ask(["a"])
    ask(["a"])
    ask(["b"])
    assert ask.replays == 2 and len(calls) == 2


def test_ddmin_result_is_one_minimal_and_keeps_order() -> None:
    candidates = names(25)
    wanted = [candidates[20], candidates[4]]
    found = ddmin(candidates, needs(*wanted))
    assert found == [candidates[4], candidates[20]]


def test_bisect_needs_a_candidate() -> None:
    with pytest.raises(ValueError):
        bisect([], needs())
