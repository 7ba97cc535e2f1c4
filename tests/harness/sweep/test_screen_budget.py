"""The alone screen's budget: a floor of tests always, then a share of a suite run's time."""

from __future__ import annotations

from capsafe_harness.sweep.isolation import SCREEN_FLOOR, SCREEN_SHARE, ScreenBudget


def test_the_floor_runs_whatever_the_time() -> None:
    budget = ScreenBudget(SCREEN_FLOOR + 5, suite_run_s=0.0, width=2)
    admitted = 0
    for _ in range(SCREEN_FLOOR + 5):
        if budget.admit():
            admitted += 1
            budget.spent(10.0)
    assert admitted == SCREEN_FLOOR and budget.skipped == 5
    assert f"{SCREEN_FLOOR} of {SCREEN_FLOOR + 5} tests" in budget.describe()
    assert "the other 5, a seeded choice, were not screened" in budget.describe()


def test_beyond_the_floor_a_share_of_a_suite_run_per_thread() -> None:
    budget = ScreenBudget(1000, suite_run_s=10.0, width=2)  # limit: SCREEN_SHARE * 10 * 2
    steps = 0
    while budget.admit():
        budget.spent(1.0)
        steps += 1
    assert steps == max(SCREEN_FLOOR, int(SCREEN_SHARE * 10.0 * 2))
    assert budget.skipped == 1


def test_a_resumed_sweep_without_a_suite_run_screens_every_test() -> None:
    budget = ScreenBudget(500, suite_run_s=None, width=2)
    assert all(budget.admit() for _ in range(500)) and budget.skipped == 0
