"""A leak victim's cause (issue 20): the tests its runs saw leave a capture open before it,
confirmed only by replays in which the leaker left its capture open again, and no
bisection. Over a fake host whose leaker leaves its capture open by a script, as a
neighbour thread breaks a real capture by chance."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import cycle
from pathlib import Path
from typing import Any, cast

from serial_host import SerialHost

from capsafe_harness.records import Signal
from capsafe_harness.sweep import leaks
from capsafe_harness.sweep.capture_sweep import CapturePhases
from capsafe_harness.sweep.host import Replayed
from capsafe_harness.sweep.searches import Searches
from capsafe_harness.sweep.store import EvidenceStore
from capsafe_harness.verdicts.catalogue import Verdict, classify, why
from capsafe_harness.verdicts.fold import Attempt

GRAPH, GRAPH2 = "test_graph.py::test_capture", "test_graph.py::test_capture2"
POOL, OTHER = "test_memory.py::test_pool_bytes", "test_memory.py::test_other"
CAPTURE_ERROR = frozenset({Signal.CAPTURE_INVALIDATED})
IN_CAPTURE = frozenset({Signal.CAPTURE_INVALIDATED, Signal.FAILED_IN_CAPTURE})


def attempt(nodeid: str, run: str, index: int, *, failed: bool = False, leaves_open: bool = False,
            signals: frozenset[str] = frozenset(), pid: int = 1) -> Attempt:  # fmt: skip
    site = ("test_graph.py:9",) if nodeid.startswith("test_graph") else ()
    return Attempt(
        nodeid, run, failed, signals, "gw0", pid, index, float(index), 1, "",
        capture_sites=site, left_open=site if leaves_open else (),
    )  # fmt: skip


class LeakHost(SerialHost):
    """Replays `L V`: L leaves its capture open when the script says so; V fails with a
    capture error exactly when one is open (or never, with `victim_fails=False`)."""

    def __init__(self, script: Sequence[bool], victim_fails: bool = True) -> None:
        super().__init__()
        self.script: Iterator[bool] = cycle(script)
        self.victim_fails = victim_fails
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    def replay(
        self, sequence: Sequence[str], *, seed: int | None, kind: str,
        extra: Sequence[str] = (), exclusive: bool = False, group: object = None,
    ) -> Replayed:  # fmt: skip
        self.asked.append((kind, tuple(sequence)))
        label, found, open_ = f"{kind}-{len(self.asked)}", {}, False
        for i, n in enumerate(sequence):
            if n.startswith("test_graph"):
                left = next(self.script)
                found[n] = attempt(n, label, i, failed=left, leaves_open=left,
                                   signals=IN_CAPTURE if left else frozenset())  # fmt: skip
                open_ = open_ or left
            else:
                hit = open_ and self.victim_fails
                found[n] = attempt(n, label, i, failed=hit,
                                   signals=CAPTURE_ERROR if hit else frozenset())  # fmt: skip
        return Replayed(label, found, 0, True, Path("log"))


def test_candidates_are_the_tests_that_left_a_capture_open_before_it_nearest_first() -> None:
    every = {
        ("run-1", a.nodeid): a
        for a in [
            attempt(GRAPH, "run-1", 0, failed=True, leaves_open=True, signals=IN_CAPTURE),
            attempt(OTHER, "run-1", 1),
            attempt(GRAPH2, "run-1", 2, failed=True, leaves_open=True, signals=IN_CAPTURE),
            attempt(POOL, "run-1", 3, failed=True, signals=CAPTURE_ERROR),
        ]
    }
    # another run: the same victim passed, and what left captures open there is no candidate
    every[("run-2", "test_graph.py::test_x")] = attempt("test_graph.py::test_x", "run-2", 0,
                                                        leaves_open=True)  # fmt: skip
    every[("run-2", POOL)] = attempt(POOL, "run-2", 1)
    assert leaks.candidates(every, POOL) == [GRAPH2, GRAPH]
    assert leaks.candidates(every, OTHER) == []  # it never failed


def test_a_replay_counts_only_when_the_leaker_left_its_capture_open_again() -> None:
    host = LeakHost([False, True, False, True, True])
    assert leaks.confirm(cast(Any, host), GRAPH, POOL, 1) == (True, 5)
    assert all(asked == ("verify", (GRAPH, POOL)) for asked in host.asked)


def test_a_victim_passing_beside_an_open_capture_refutes_the_leaker() -> None:
    host = LeakHost([True], victim_fails=False)
    assert leaks.confirm(cast(Any, host), GRAPH, POOL, 1) == (False, 1)


def test_a_leaker_whose_capture_never_breaks_again_gives_up_within_its_tries() -> None:
    host = LeakHost([False])
    assert leaks.confirm(cast(Any, host), GRAPH, POOL, 1) == (False, leaks.TRIES_PER_CANDIDATE)


def store_with_leak(tmp_path: Path) -> EvidenceStore:
    store = EvidenceStore(tmp_path, 60.0)
    store.collected = (GRAPH, OTHER, POOL)
    store.run_ids.append("run-1")
    store.seeds.append(1)
    for a in [
        attempt(GRAPH, "run-1", 0, failed=True, leaves_open=True, signals=IN_CAPTURE),
        attempt(OTHER, "run-1", 1),
        attempt(POOL, "run-1", 2, failed=True, signals=CAPTURE_ERROR),
    ]:
        store.run_attempts[("run-1", a.nodeid)] = a
        ev = store.ev(a.nodeid)
        ev.runs, ev.failures, ev.isolation_runs = 1, int(a.failed), 3
        ev.leak_failures = int(a.leak_victim)
    store.ev(GRAPH).capture.capture_failures = 1  # capture-unsafe: never searched
    store.ev(GRAPH).capture.control_runs = 2
    return store


def test_a_leak_victim_is_explained_by_its_leaker_without_a_bisection(tmp_path: Path) -> None:
    store = store_with_leak(tmp_path)
    # Alone it failed once, beside neighbour threads (a pool count they moved), never without.
    pool = store.ev(POOL)
    pool.isolation_failures, pool.capture.control_runs = 1, 2
    pool.thread_unsafe = "tests shared self.pool properties"
    host = LeakHost([True, False, True, True])
    searches = Searches(cast(Any, host), store, CapturePhases(2, store=store.evidence),
                        cast(Any, None), cast(Any, None))  # fmt: skip
    assert searches.jobs() == [("polluter", POOL)]
    searches.run()
    assert host.asked == [("verify", (GRAPH, POOL))] * 4  # one said nothing: its capture ended
    assert pool.polluters == [GRAPH]
    assert classify(pool) == Verdict.ORDER_DEPENDENT
    text = why(Verdict.ORDER_DEPENDENT, pool)
    assert f"{GRAPH} left a capture open" in text
    assert "all beside neighbour threads" in text and "self.pool properties" in text


def test_an_unconfirmed_leaker_is_named_as_unconfirmed_and_not_as_the_cause(
    tmp_path: Path,
) -> None:
    store = store_with_leak(tmp_path)
    host = LeakHost([False])
    searches = Searches(cast(Any, host), store, CapturePhases(2, store=store.evidence),
                        cast(Any, None), cast(Any, None))  # fmt: skip
    searches.run()
    pool = store.ev(POOL)
    assert (pool.polluters, pool.unconfirmed) == ([], [GRAPH])
    assert len(host.asked) == leaks.TRIES_PER_CANDIDATE
    assert classify(pool) != Verdict.ORDER_DEPENDENT


def test_failures_alone_without_neighbours_keep_a_leak_victim_from_order_dependent(
    tmp_path: Path,
) -> None:
    store = store_with_leak(tmp_path)
    pool = store.ev(POOL)
    pool.polluters = [GRAPH]
    pool.isolation_failures, pool.capture.control_runs, pool.capture.control_failures = 1, 2, 1
    assert not pool.failed_alone_only_beside_neighbours
    assert classify(pool) != Verdict.ORDER_DEPENDENT


def test_a_capturing_test_that_ran_into_an_open_capture_before_its_own_is_a_leak_victim(
    tmp_path: Path,
) -> None:
    # CuPy's test_stream_fork_join[False] on the H200: it captures, yet in one neighbour run
    # of four it failed with cudaErrorStreamCaptureImplicit before its own capture began, and
    # came out neighbour-sensitive with the capture error unexplained.
    store = store_with_leak(tmp_path)
    pool = store.ev(POOL)
    pool.capture_sites = ["test_memory.py:30"]  # where it captured in its other runs
    pool.capture.neighbor_runs, pool.capture.neighbor_failures = 4, 1
    pool.capture.control_runs = 2  # passed every run without neighbours
    assert pool.leak_victim and not pool.capture_unsafe
    unconfirmed = LeakHost([False])
    searches = Searches(cast(Any, unconfirmed), store, CapturePhases(2, store=store.evidence),
                        cast(Any, None), cast(Any, None))  # fmt: skip
    assert searches.jobs() == [("polluter", POOL)]
    searches.run()
    assert (pool.polluters, pool.unconfirmed) == ([], [GRAPH])
    assert classify(pool) == Verdict.NEIGHBOUR_SENSITIVE  # never flaky, never a false cause
    text = why(Verdict.NEIGHBOUR_SENSITIVE, pool)
    assert f"in a process where {GRAPH} left a capture open (not confirmed" in text
    pool.polluters, pool.unconfirmed = [GRAPH], []  # confirmed: the cause, by name
    assert classify(pool) == Verdict.ORDER_DEPENDENT
    assert why(Verdict.ORDER_DEPENDENT, pool).endswith(f"{GRAPH} left a capture open")


def test_a_capturing_test_that_also_failed_otherwise_is_searched_as_any_test(
    tmp_path: Path,
) -> None:
    # One open capture must not hide a polluter: a test that captures and failed runs of
    # another kind too gets the ordinary search, not only the leakers' replays.
    store = store_with_leak(tmp_path)
    pool = store.ev(POOL)
    CapturePhases(2, store=store.evidence).saw(attempt(POOL, "run-2", 0, failed=True),
                                               neighbors=True)  # fmt: skip
    assert pool.other_failures == 1
    assert pool.leak_victim  # it never captured: the capture left open is still its cause
    pool.capture_sites = ["test_memory.py:30"]
    assert not pool.leak_victim
    host, parallel_checked = LeakHost([False]), []

    class Parallel:  # the parallel phase's check, which a leak victim never gets
        def check(self, nodeid: str) -> None:
            parallel_checked.append(nodeid)

    searches = Searches(cast(Any, host), store, CapturePhases(2, store=store.evidence),
                        cast(Any, None), cast(Any, Parallel()))  # fmt: skip
    searches.run()
    assert any(kind == "replay" for kind, _ in host.asked)  # the bisection ran
    assert parallel_checked == [POOL]
