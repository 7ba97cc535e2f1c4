"""What report.md and report.html share: the heat map's cells, the order of the tests,
the verdict line, the pairs and the search bound."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from ..records import Signal
from ..verdicts.catalogue import CLASSES, Verdict, severity
from . import tables
from .summary import Summary


class Cell(StrEnum):
    """Every state of a heat-map cell (the sweep fills the grid with these)."""

    PASSED = "passed"
    FAILED = "failed"
    TIMEOUT = Signal.TIMEOUT.value
    CRASH = Signal.CRASH.value
    NOT_RUN = "none"


CELL_LABELS = {
    Cell.PASSED: "passed",
    Cell.FAILED: "failed",
    Cell.TIMEOUT: "timed out",
    Cell.CRASH: "crashed",
    Cell.NOT_RUN: "not run",
}
"""Each cell state's legend."""

OUTCOME_COLOURS = {"skipped": "#6e7781", "xfailed": "#9a6700", "xpassed": "#bf3989"}
"""Outcomes a test classed `pass` can have besides passed, shown as their own."""


def per_test(
    summary: Summary, tests: Sequence[Mapping[str, Any]] | None
) -> list[Mapping[str, Any]]:
    """`tests` worst first; without records, the summary's tests with what it says alone."""
    if tests is None:
        tests = tables.per_test_table(summary.tests, tables.outcomes_by_test([]))
    return worst_first(tests)


def other_outcomes(tests: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Tests classed pass whose outcome was skipped, xfailed or xpassed."""
    return [
        t
        for t in tests
        if t["classification"] == Verdict.PASS and t.get("outcome") in OUTCOME_COLOURS
    ]


def leaky_tests(tests: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [t for t in tests if t.get("env_leaks")]


def outcome_counts(tests: Sequence[Mapping[str, Any]]) -> str:
    """ "passed 3 · skipped 1" for the tests classed pass, "" when all of them passed."""
    passing = [t.get("outcome", "passed") for t in tests if t["classification"] == Verdict.PASS]
    if all(o == "passed" for o in passing):
        return ""
    shown = ("passed", *OUTCOME_COLOURS)
    return " · ".join(f"{o} {passing.count(o)}" for o in shown if passing.count(o))


def worst_first(tests: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Tests by class (worst first), then by flake rate, then by name."""
    return sorted(
        tests, key=lambda t: (severity(t["classification"]), -t["flake_rate"], t["nodeid"])
    )


def pairs(tests: Iterable[Mapping[str, Any]]) -> list[tuple[str, list[str], str]]:
    """(kind, causes, test) for every polluter -> victim and state-setter -> brittle found."""
    found = []
    for t in worst_first(tests):
        if t["polluters"]:
            found.append(("polluter", list(t["polluters"]), t["nodeid"]))
        if t["state_setters"]:
            found.append(("state-setter", list(t["state_setters"]), t["nodeid"]))
    return found


def search_bound(candidates: int) -> int:
    """The replay budget for one culprit among `candidates`: ceil(log2 n) + 3."""
    return math.ceil(math.log2(candidates)) + 3 if candidates > 0 else 0


def shard_line(shard: str) -> str:
    """The line that marks a shard's report (`shard`: "K/N") as a partial view."""
    index, count = shard.split("/")
    return (
        f"shard {index} of {count}: partial view (its runs and its share of the alone "
        "reruns, no searches); `capsafe merge` over every shard gives the verdicts"
    )


def not_counted(outcomes: Mapping[str, int]) -> str:
    """ "2 skipped, 1 xfailed": the tests classed pass that did not simply pass."""
    return ", ".join(f"{outcomes[o]} {o}" for o in OUTCOME_COLOURS if outcomes.get(o))


def passing_phrase(total: int, outcomes: Mapping[str, int]) -> str:
    """ "all 5 tests that ran pass; 2 skipped, 1 xfailed not counted as pass" for a sweep
    with nothing to attend to: skipped, xfailed and xpassed tests are never counted as a pass
    (`outcomes`: Summary.outcomes)."""
    others = not_counted(outcomes)
    if not others:
        return f"all {total} tests pass"
    ran = total - sum(outcomes.get(o, 0) for o in OUTCOME_COLOURS)
    if ran == 0:
        return f"no test ran to a pass: {others}"
    return f"all {ran} tests that ran pass; {others} not counted as pass"


def class_counts(summary: Summary) -> dict[str, int]:
    """Tests per class for the cards and tables, `pass` without the skipped, xfailed and
    xpassed ones (the outcome line beside them counts those)."""
    counts = {c: summary.counts.get(c, 0) for c in CLASSES}
    counts[Verdict.PASS] -= sum(summary.outcomes.get(o, 0) for o in OUTCOME_COLOURS)
    return counts


def verdict_line(summary: Summary, total: int, bad: int) -> str:
    suite = suite_errors_text(summary.suite_errors, summary.runs)
    if summary.interrupted:  # a partial report never says "all pass"
        found = f"{bad} of them need attention" if bad else "none failing"
        return f"{summary.interrupted}: {found} so far." + (f" Also, {suite}." if suite else "")
    if total == 0:
        return "No tests ran."
    if bad == 0:
        phrase = passing_phrase(total, summary.outcomes)
        return phrase[0].upper() + phrase[1:] + (f", but {suite}." if suite else ".")
    others = not_counted(summary.outcomes)
    return (f"{bad} of {total} tests need attention."
            + (f" {others} not counted as pass." if others else "")
            + (f" Also, {suite}." if suite else ""))  # fmt: skip


def suite_errors_text(errors: Sequence[Mapping[str, Any]], runs: int) -> str:
    """ "pytest failed 2 of 3 suite runs with no test failing (exit 1: RuntimeError: ...)"."""
    if not errors:
        return ""
    first = errors[0]
    return (f"pytest failed {len(errors)} of {runs} suite runs with no test failing "
            f"(exit {first['returncode']}: {first['message']})")  # fmt: skip


def pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def evidence_lines(test: Mapping[str, Any]) -> list[str]:
    """The sweep's words for a verdict and its chance of being seen, where it gave them."""
    lines = [f"{test['why']}", ""] if test.get("why") else []
    chance = test.get("detection_chance")
    if chance is not None:
        lines += [f"Chance a sweep of {test['runs']} runs shows it: {pct(chance)}", ""]
    return lines


def fix_of(test: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A test's verified patch (`capsafe sweep --fix`): path, diff, how, source, patch, apply."""
    fix = test.get("fix")
    return fix if isinstance(fix, Mapping) and fix.get("diff") else None


def cleaners_of(test: Mapping[str, Any]) -> list[str]:
    """The verified cleaners of an order-dependent test (`capsafe sweep --fix`)."""
    found = test.get("cleaners")
    return [str(c) for c in found] if isinstance(found, list | tuple) else []


def fix_line(test: Mapping[str, Any]) -> str:
    """ "Verified fix: HOW; apply: capsafe fix OUT TEST" for a test with a patch, else ''."""
    fix = fix_of(test)
    return f"Verified fix: {fix['how']}; apply: {fix['apply']}" if fix else ""
