"""Finding who made a test fail (a polluter) or pass (a state-setter).

The search only needs an oracle: "replay these tests, then the target, in one
process; did the target do the thing we are explaining?" For a victim that is
"it failed", for a brittle test "it passed". The oracle is expensive (a fresh
pytest process), so every distinct question is asked once and counted.

Strategy, cheapest first:
0. Causes already found for other tests (`hints`): one replay each.
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


class _CapReached(Exception):
    pass


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
            return SearchResult(target, len(prefix), ask.replays, tuple(known), True)
    if not prefix or not ask(prefix):
        return SearchResult(target, len(prefix), ask.replays, (), False)
    culprits = [bisect(prefix, ask)]
    capped = False
    if not ask(culprits):
        culprits, capped = capped_ddmin(prefix, ask, ddmin_cap)
    return SearchResult(target, len(prefix), ask.replays, tuple(culprits), True, capped)


def capped_ddmin(candidates: Sequence[str], oracle: Oracle, cap: int) -> tuple[list[str], bool]:
    """ddmin that asks at most `cap` distinct questions: (the smallest set so far, cap hit?)."""
    best = list(candidates)
    asked: set[tuple[str, ...]] = set()

    def bounded(tests: Sequence[str]) -> bool:
        nonlocal best
        if tuple(tests) not in asked:
            if len(asked) >= cap:
                raise _CapReached
            asked.add(tuple(tests))
        held = oracle(tests)
        if held and len(tests) < len(best):
            best = list(tests)
        return held

    try:
        return ddmin(candidates, bounded), False
    except _CapReached:
        return best, True


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


def bisect(candidates: Sequence[str], oracle: Oracle) -> str:
    """The one candidate a single-culprit bisection ends on (not itself re-checked).

    Keeps the first half when it reproduces, else the second half without asking:
    under the single-culprit assumption it must be there. ceil(log2 n) questions.
    """
    if not candidates:
        raise ValueError("bisect needs at least one candidate")
    rest = list(candidates)
    while len(rest) > 1:
        half = len(rest) // 2
        rest = rest[:half] if oracle(rest[:half]) else rest[half:]
    return rest[0]


def ddmin(candidates: Sequence[str], oracle: Oracle) -> list[str]:
    """Zeller's delta debugging: a 1-minimal subset (order kept) for which `oracle` holds.

    `oracle(candidates)` must hold. Removing any single test from the answer
    breaks reproduction, so every test in it is needed.
    """
    items = list(candidates)
    granularity = 2
    while len(items) >= 2:
        chunks = _split(items, granularity)
        reduced = next((c for c in chunks if oracle(c)), None)
        if reduced is not None:
            items, granularity = reduced, 2
            continue
        if granularity > 2:
            complement = next((comp for c in chunks if oracle(comp := _without(items, c))), None)
            if complement is not None:
                items, granularity = complement, max(granularity - 1, 2)
                continue
        if granularity >= len(items):
            break
        granularity = min(len(items), granularity * 2)
    return items


def _split(items: list[str], parts: int) -> list[list[str]]:
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return [c for c in chunks if c]


def _without(items: list[str], chunk: list[str]) -> list[str]:
    drop = set(chunk)
    return [i for i in items if i not in drop]
