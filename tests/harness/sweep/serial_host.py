"""The part of a fake sweep `Host` every phase test shares: jobs run one at a time, in
this thread, with budget always left; notes kept. Subclasses say what a replay gives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any


class SerialHost:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def pool(
        self, desc: str, jobs: Sequence[Any], work: Callable[[Any, int], list[Any]],
        target: Callable[[Any], str | None] | None = None,
    ) -> None:  # fmt: skip
        queue = list(jobs)
        while queue:
            queue += work(queue.pop(0), 0)

    def only(self) -> AbstractContextManager[object]:
        return nullcontext(object())

    def budget_left(self) -> bool:
        return True

    def note(self, text: str) -> None:
        self.notes.append(text)
