"""A seeded xdist scheduler: which worker runs which test is a function of the order seed.

xdist's `load` scheduler hands tests to whichever worker finishes first, so the
same seed gives the same order but a different split across workers from run to
run, and a failure that depends on what ran before it in its worker does not
repeat. Here every worker gets its whole sequence up front: the collection (in
the seeded order all workers computed) dealt round-robin over the workers sorted
by id. A crashed worker's unrun tests go, in order, to the worker xdist starts
in its place. The price is xdist's load balancing: a worker that draws slow tests
finishes last.

Imported only by the xdist controller, and only with `--capsafe-seed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from xdist.report import report_collection_diff  # type: ignore[import-untyped]
from xdist.workermanage import (  # type: ignore[import-untyped]
    WorkerController,
    parse_tx_spec_config,
)


def deal(count: int, workers: int) -> list[list[int]]:
    """Indices 0..count-1 dealt round-robin: worker k gets k, k + workers, k + 2*workers, ..."""
    return [list(range(k, count, workers)) for k in range(workers)]


def _worker_number(node: WorkerController) -> int:
    """gw3 -> 3: workers are ordered by id, never by the order they came up in."""
    gateway_id = str(node.gateway.id)
    digits = gateway_id.lstrip("gw")
    return int(digits) if digits.isdigit() else 0


class SeededScheduling:
    """xdist's scheduler protocol with a fixed assignment of tests to workers."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        self.config = config
        self.numnodes = len(parse_tx_spec_config(config))
        self.node2collection: dict[WorkerController, list[str]] = {}
        self.node2pending: dict[WorkerController, list[int]] = {}
        self.collection: list[str] | None = None
        self.started: set[WorkerController] = set()
        self.orphans: list[list[int]] = []  # unrun sequences of crashed workers, oldest first
        self.log = log.seededsched if log is not None else (lambda *args: None)

    @property
    def nodes(self) -> list[WorkerController]:
        return list(self.node2pending)

    @property
    def collection_is_completed(self) -> bool:
        return len(self.node2collection) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        if self.collection is None or self.orphans:
            return False
        return all(len(pending) < 2 for pending in self.node2pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.orphans) or any(self.node2pending.values())

    def add_node(self, node: WorkerController) -> None:
        self.node2pending[node] = []

    def add_node_collection(self, node: WorkerController, collection: Sequence[str]) -> None:
        if self.collection is not None and list(collection) != self.collection:
            first = next(iter(self.node2collection))
            self.log(
                report_collection_diff(
                    self.collection, list(collection), first.gateway.id, node.gateway.id
                )
            )
            return
        self.node2collection[node] = list(collection)

    def mark_test_complete(
        self, node: WorkerController, item_index: int, duration: float = 0
    ) -> None:
        self.node2pending[node].remove(item_index)

    def mark_test_pending(self, item: str) -> None:
        """Run `item` again: first, on the worker that replaces the one it crashed."""
        assert self.collection is not None
        index = self.collection.index(item)
        if self.orphans:
            self.orphans[-1].insert(0, index)
        else:
            self.orphans.append([index])

    def remove_pending_tests_from_node(
        self, node: WorkerController, indices: Sequence[int]
    ) -> None:
        raise NotImplementedError("only work-stealing schedulers take tests back")

    def remove_node(self, node: WorkerController) -> str | None:
        pending = self.node2pending.pop(node)
        self.started.discard(node)
        if not pending:
            return None
        assert self.collection is not None
        crashed = self.collection[pending.pop(0)]
        if pending:
            self.orphans.append(pending)
        return crashed

    def schedule(self) -> None:
        if self.collection is None:
            if not self._same_collections():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = next(iter(self.node2collection.values()))
            workers = sorted(self.node2pending, key=_worker_number)
            for node, sequence in zip(
                workers, deal(len(self.collection), len(workers)), strict=True
            ):
                self._start(node, sequence)
            return
        for node in sorted(self.node2pending, key=_worker_number):
            if node not in self.started and node in self.node2collection:
                self._start(node, self.orphans.pop(0) if self.orphans else [])

    def _start(self, node: WorkerController, sequence: list[int]) -> None:
        self.started.add(node)
        self.node2pending[node].extend(sequence)
        if sequence:
            node.send_runtest_some(sequence)
        node.shutdown()

    def _same_collections(self) -> bool:
        (first, reference), *others = self.node2collection.items()
        same = True
        for node, collection in others:
            diff = report_collection_diff(reference, collection, first.gateway.id, node.gateway.id)
            if diff:
                same = False
                self.log(diff)
                self.config.hook.pytest_collectreport(
                    report=pytest.CollectReport(
                        nodeid=node.gateway.id, outcome="failed", longrepr=diff, result=[]
                    )
                )
        return same
