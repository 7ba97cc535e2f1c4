"""Finding who made a test fail (a polluter) or pass (a state-setter).

The search only needs an oracle: "replay these tests, then the target, in one
process; did the target do the thing we are explaining?" For a victim that is
"it failed", for a brittle test "it passed". The oracle is expensive (a fresh
pytest process), so every distinct question is asked once and counted.

Strategy, cheapest first:
0. Causes already found for other tests (`hints`): one replay each, and a cause of
   several tests that reproduces is cut to the fewest of them that still do (ddmin).
1. Replay the whole prefix: if the target does not reproduce, there is nothing
   to search (a nondeterministic failure, or a cause in another process).
2. Bisect assuming one culprit: ceil(log2 n) replays.
3. If that single culprit does not reproduce on its own, several tests are
   needed together: delta debugging (ddmin) over the whole prefix finds a
   1-minimal set, within `ddmin_cap` replays (the result says when it stopped there).
Total for a single culprit among n: at most ceil(log2 n) + 2 replays. The sweep
then verifies what was found, K times each way (harness.sweep.searches), counted apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..fix.delta import bisect, capped_ddmin
from ..plugin.order import class_of, module_of

DDMIN_CAP = 100
"""Replays one delta-debugging search may spend before it stops with what it has."""

Oracle = Callable[[Sequence[str]], bool]
"""True when replaying these node ids, then the target, reproduces what is searched for."""


class CountingOracle:
    """Asks each distinct question once and counts the replays actually run."""

    def __init__(self, oracle: Oracle) -> None:
        self._oracle = oracle
        self._answers: dict[tuple[str, ...], bool] = {}

    @property
    def replays(self) -> int:
        return len(self._answers)

    def __call__(self, tests: Sequence[str]) -> bool:
        key = tuple(tests)
        if key not in self._answers:
            self._answers[key] = bool(self._oracle(key))
        return self._answers[key]


@dataclass(frozen=True)
class SearchResult:
    """What one search found, not yet verified. `culprits` is empty when nothing reproduced."""

    target: str
    candidates: int
    replays: int
    culprits: tuple[str, ...]
    reproduced: bool  # did the whole prefix (or a hint) reproduce the outcome?
    capped: bool = False  # ddmin stopped at its cap: `culprits` may not be minimal


def search(
    target: str,
    candidates: Sequence[str],
    oracle: Oracle,
    *,
    hints: Iterable[Sequence[str]] = (),
    ddmin_cap: int = DDMIN_CAP,
) -> SearchResult:
    """Find the smallest set of `candidates` that, run before `target`, reproduces the outcome."""
    ask = CountingOracle(oracle)
    prefix = list(dict.fromkeys(c for c in candidates if c != target))
    for hint in hints:
        known = [c for c in hint if c != target]
        if known and ask(known):
            # Another victim needed all of them; this one may need fewer (freezegun seed 4:
            # a victim of one test_utils test was named with the pair another victim needs).
            known, capped = (
                capped_ddmin(known, ask, ddmin_cap) if len(known) > 1 else (known, False)
            )
            return SearchResult(target, len(prefix), ask.replays, tuple(known), True, capped)
    if not prefix or not ask(prefix):
        return SearchResult(target, len(prefix), ask.replays, (), False)
    culprits = [bisect(prefix, ask)]
    capped = False
    if not ask(culprits):
        culprits, capped = capped_ddmin(prefix, ask, ddmin_cap)
    return SearchResult(target, len(prefix), ask.replays, tuple(culprits), True, capped)


def grouped(nodeids: Sequence[str], last_module: str) -> list[str]:
    """`nodeids` with each module's (and, in it, each class's) tests together, in their
    given order, and `last_module`'s tests last: a candidate order in which module- and
    class-scoped fixtures live across a module's tests, as in the project's own order."""
    modules: dict[str, list[str]] = {}
    for nodeid in nodeids:
        modules.setdefault(module_of(nodeid), []).append(nodeid)
    ordered = [tests for module, tests in modules.items() if module != last_module]
    ordered.append(modules.get(last_module, []))
    out: list[str] = []
    for tests in ordered:
        classes: dict[str, list[str]] = {}
        for nodeid in tests:
            classes.setdefault(class_of(nodeid), []).append(nodeid)
        out += [n for group in classes.values() for n in group]
    return out
