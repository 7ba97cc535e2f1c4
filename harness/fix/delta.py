"""Delta debugging: the smallest part of a list for which a test (an oracle) still holds.

Generic over what is minimised: the sweep's cause search minimises node ids (which tests must
run before a victim), the fix engine minimises statements (which of a cleaner's statements a
patch needs). The oracle is expensive (a fresh pytest process), so callers count and cache it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


class _CapReached(Exception):
    pass


def capped_ddmin(
    candidates: Sequence[T], oracle: Callable[[Sequence[T]], bool], cap: int
) -> tuple[list[T], bool]:
    """ddmin that asks at most `cap` distinct questions: (the smallest set so far, cap hit?)."""
    best = list(candidates)
    asked: set[tuple[T, ...]] = set()

    def bounded(items: Sequence[T]) -> bool:
        nonlocal best
        if tuple(items) not in asked:
            if len(asked) >= cap:
                raise _CapReached
            asked.add(tuple(items))
        held = oracle(items)
        if held and len(items) < len(best):
            best = list(items)
        return held

    try:
        return ddmin(candidates, bounded), False
    except _CapReached:
        return best, True


def bisect(candidates: Sequence[T], oracle: Callable[[Sequence[T]], bool]) -> T:
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


def ddmin(candidates: Sequence[T], oracle: Callable[[Sequence[T]], bool]) -> list[T]:
    """Zeller's delta debugging: a 1-minimal subset (order kept) for which `oracle` holds.

    `oracle(candidates)` must hold. Removing any single item from the answer
    breaks it, so every item in it is needed.
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


def _split(items: list[T], parts: int) -> list[list[T]]:
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return [c for c in chunks if c]


def _without(items: list[T], chunk: list[T]) -> list[T]:
    drop = set(chunk)
    return [i for i in items if i not in drop]
