"""The cause searches over a fake host that replays a model of shared state (issue 24,
issue 20, issue 21): which tests get a search, a cause tried on the next victim first, and
a verified cause replayed directly before every other test, past the cleaners."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from serial_host import SerialHost

from capsafe_harness.records import Signal
from capsafe_harness.sweep import searches as searches_module
from capsafe_harness.sweep.capture_sweep import CapturePhases
from capsafe_harness.sweep.host import Replayed
from capsafe_harness.sweep.searches import Searches
from capsafe_harness.sweep.store import EvidenceStore
from capsafe_harness.verdicts.fold import Attempt

P = "config/test_config.py::test_pollute"
V1, V2 = "a/test_a.py::test_v1", "b/test_b.py::test_v2"
CLEAN = "c/test_c.py::TestClean::test_clean"  # its teardown restores the state
V3 = "c/test_c.py::test_v3"  # after the cleaners of its own module: no module screen shows it
SETTER, BRITTLE = "d/test_d.py::test_set", "e/test_e.py::test_brittle"
PADS = [f"f/test_f.py::test_pad{i}" for i in range(4)]
COLLECTED = (V1, V2, CLEAN, V3, P, SETTER, BRITTLE, *PADS)


def outcomes(sequence: Sequence[str]) -> dict[str, bool]:
    """Did each test fail, run in this order in one process? P pollutes, CLEAN restores,
    the V tests fail when polluted; SETTER sets what BRITTLE needs."""
    polluted, loaded = False, False
    failed: dict[str, bool] = {}
    for test in sequence:
        failed[test] = failed.get(test, False) or (
            (test in (V1, V2, V3) and polluted) or (test == BRITTLE and not loaded)
        )
        polluted = (polluted or test == P) and test != CLEAN
        loaded = loaded or test == SETTER
    return failed


Model = Callable[[Sequence[str]], dict[str, bool]]


def attempt(nodeid: str, failed: bool, run: str, index: int) -> Attempt:
    return Attempt(nodeid, run, failed, frozenset(), "main", 1, index, float(index), 1, "")


class ModelHost(SerialHost):
    """Replays sequences through `outcomes`, one job at a time, and keeps what it was asked."""

    def __init__(self, model: Model = outcomes) -> None:
        self.model = model
        self.asked: list[tuple[str, tuple[str, ...]]] = []
        super().__init__()

    def replay(
        self, sequence: Sequence[str], *, seed: int | None, kind: str,
        extra: Sequence[str] = (), exclusive: bool = False, group: object = None,
    ) -> Replayed:  # fmt: skip
        self.asked.append((kind, tuple(sequence)))
        label = f"{kind}-{len(self.asked)}"
        done = self.model(sequence).items()
        found = {n: attempt(n, f, label, i) for i, (n, f) in enumerate(done)}
        return Replayed(label, found, 0, True, Path("log"), runs_failed(self.model, sequence))


def runs_failed(model: Model, sequence: Sequence[str]) -> dict[str, tuple[bool, ...]]:
    """Each run of each test: failed? The models fold a test's runs into one answer, so a
    run is asked of the model as what ran before it, the test's own earlier runs left out
    (in these models only the causes and cleaners change state, and those are never run
    twice with their own outcome in question)."""
    runs: dict[str, tuple[bool, ...]] = {}
    for k, test in enumerate(sequence):
        before = [n for n in sequence[:k] if n != test]
        runs[test] = (*runs.get(test, ()), model([*before, test])[test])
    return runs


def store_after_runs(
    tmp_path: Path, runs: Sequence[Sequence[str]], model: Model = outcomes,
    collected: tuple[str, ...] = COLLECTED,
) -> EvidenceStore:  # fmt: skip
    """The store as the suite runs and the alone reruns (3 each, as the model says) left it."""
    store = EvidenceStore(tmp_path, 60.0)
    store.collected = collected
    for k, sequence in enumerate(runs, 1):
        run_id = f"run-{k}"
        store.run_ids.append(run_id)
        store.seeds.append(k)
        for i, (nodeid, failed) in enumerate(model(sequence).items()):
            store.run_attempts[(run_id, nodeid)] = attempt(nodeid, failed, run_id, i)
            ev = store.ev(nodeid)
            ev.runs += 1
            ev.failures += failed
    for nodeid in collected:
        ev = store.ev(nodeid)
        ev.isolation_runs = 3
        ev.isolation_failures = 3 * model([nodeid])[nodeid]
    return store


class NoParallel:
    def check(self, nodeid: str) -> None:
        pass


def searches_over(store: EvidenceStore, host: ModelHost) -> Searches:
    nothing = cast(Any, None)  # the alone reruns are done: verification needs no more
    capture = CapturePhases(0, store=store.evidence)
    return Searches(host, store, capture, nothing, cast(Any, NoParallel()))


def test_a_test_failing_only_alone_gets_a_state_setter_search(tmp_path: Path) -> None:
    # BRITTLE passed in every suite run (SETTER ran before it) and failed every rerun alone:
    # the alone run every test gets shows it, and its state-setter is searched.
    store = store_after_runs(tmp_path, [[SETTER, BRITTLE, *PADS], [P, SETTER, *PADS, BRITTLE]])
    assert store.ev(BRITTLE).failures == 0
    searches = searches_over(store, host := ModelHost())
    assert ("state-setter", BRITTLE) in searches.jobs()
    searches.run()
    assert store.ev(BRITTLE).state_setters == [SETTER]
    assert not [a for a in host.asked if a[1][-1] != BRITTLE and BRITTLE not in a[1]]


def test_a_test_that_never_passed_replays_only_the_projects_order(tmp_path: Path) -> None:
    # Issue 20: failed every suite run and every rerun alone. No order the sweep ran lets it
    # pass, so no search: one replay of the project's own order (which here does not pass).
    store = store_after_runs(tmp_path, [[BRITTLE, SETTER], [BRITTLE, *PADS]])
    store.collected = (*PADS, BRITTLE, SETTER)  # the project's order
    searches = searches_over(store, host := ModelHost())
    assert searches.jobs() == [("state-setter", BRITTLE)]
    searches.run()
    assert host.asked == [("replay", (*PADS, BRITTLE))]
    assert store.ev(BRITTLE).state_setters == []


def test_a_cause_found_once_is_tried_on_the_next_victim_before_any_search(
    tmp_path: Path,
) -> None:
    # Issue 21: V1 and V2 both failed after P. V1's search finds and verifies P; V2's search
    # then asks P alone before V2 first, and that one replay (then verification) settles it.
    store = store_after_runs(tmp_path, [[*PADS[:2], P, V1, *PADS[2:]], [PADS[0], P, PADS[1], V2]])
    searches = searches_over(store, host := ModelHost())
    searches.run()
    assert store.ev(V1).polluters == store.ev(V2).polluters == [P]
    v2_asked = [seq for kind, seq in host.asked if seq[-1] == V2 and kind == "replay"]
    assert v2_asked[0] == (P, V2), v2_asked
    (v2_search,) = [s for s in store.searches if s.victim == V2]
    assert v2_search.replays == 1


def test_a_verified_polluter_is_replayed_before_every_test_past_the_cleaners(
    tmp_path: Path,
) -> None:
    # V3 never failed in a run: CLEAN (its own module's cleaner, first in the module) always
    # ran between P and it. Screening P before V3's module runs CLEAN first too, so only P
    # replayed directly before each test in turn (`P X1 P X2 ...`) shows it. The block
    # screen (`P X1 ... Xn V1`) shows V1 passing at its end: the block is paired again.
    store = store_after_runs(tmp_path, [[P, V1, CLEAN, V3, *PADS], [P, CLEAN, *PADS, V3]])
    assert store.ev(V3).failures == 0
    searches = searches_over(store, host := ModelHost())
    searches.run()
    assert store.ev(V3).polluters == [P]
    block, pairs = [seq for kind, seq in host.asked if kind == "pairs"]
    assert block.count(P) == 1 and block[0] == P and block[-1] == V1 and CLEAN in block
    assert pairs[0::2] == (P,) * (len(pairs) // 2) and V3 in pairs[1::2]
    wrong = [n for n in COLLECTED if store.ev(n).polluters and n not in (V1, V2, V3)]
    assert not wrong


def test_a_block_its_victim_still_fails_after_needs_no_pair_by_pair_screen(
    tmp_path: Path,
) -> None:
    # No cleaner: P's state outlives every test, so one process of blocks (`P X1 ... V1`)
    # shows V2 and V3, which no run put after P, at one replay of P a block.
    collected = (P, V1, V2, V3, *PADS)
    store = store_after_runs(tmp_path, [[P, V1, *PADS], [V2, V3, P, *PADS]], collected=collected)
    assert (store.ev(V1).failures, store.ev(V2).failures, store.ev(V3).failures) == (1, 0, 0)
    searches_over(store, host := ModelHost()).run()
    assert store.ev(V2).polluters == store.ev(V3).polluters == [P]
    (block,) = [seq for kind, seq in host.asked if kind == "pairs"]
    assert block.count(P) == 1 and block[-1] == V1 and {V2, V3} <= set(block)


def store_cleaner_first(tmp_path: Path) -> EvidenceStore:
    """P's screen meets CLEAN first, V3 behind it, then the pads, then V1 (the sentinel)
    and V2; only V1 failed in a run."""
    collected = (P, CLEAN, V3, *PADS, V1, V2)
    store = store_after_runs(tmp_path, [[P, V1, *PADS], [V2, P, CLEAN, V3]], collected=collected)
    assert (store.ev(V1).failures, store.ev(V2).failures, store.ev(V3).failures) == (1, 0, 0)
    return store


def test_the_sentinels_own_run_in_a_later_block_is_no_blocks_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of two: [CLEAN, V3] [PAD0, PAD1] [PAD2, PAD3] [V1, V2], each ended by V1. V1 runs
    # five times; its fourth run is its own, in the last block. Only the first block's V1
    # passed (CLEAN emptied it), so only that block is paired again, and V3 is found there.
    monkeypatch.setattr(searches_module, "SENTINEL_EVERY", 2)
    store = store_cleaner_first(tmp_path)
    searches_over(store, host := ModelHost()).run()
    assert store.ev(V2).polluters == store.ev(V3).polluters == [P]
    blocks, pairs = [seq for kind, seq in host.asked if kind == "pairs"]
    assert blocks.count(P) == 4 and blocks.count(V1) == 5
    assert pairs == (P, CLEAN, P, V3)


def test_a_cleaner_in_the_first_process_turns_the_rest_of_the_screen_to_pairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Processes of about two tests: [CLEAN, V3] first, then the pads, then [V1, V2]. The
    # first block's V1 passed: cleaners are common, so the later processes pair from the
    # start instead of paying for a block and then its pairs.
    monkeypatch.setattr(searches_module, "PAIRS_PER_REPLAY", 2)
    store = store_cleaner_first(tmp_path)
    searches_over(store, host := ModelHost()).run()
    assert store.ev(V2).polluters == store.ev(V3).polluters == [P]
    first, *rest = [seq for kind, seq in host.asked if kind == "pairs"]
    assert first == (P, CLEAN, V3, V1)
    assert rest and all(seq[0::2] == (P,) * (len(seq) // 2) for seq in rest)
    assert (P, CLEAN, P, V3) in rest and (P, PADS[0], P, PADS[1], P, PADS[2], P, PADS[3]) in rest


class HangingHost(ModelHost):
    """V1 times out where it fails (pytest-timeout's signal ends it, the process goes on)."""

    def replay(self, sequence: Sequence[str], **kw: Any) -> Replayed:
        done = super().replay(sequence, **kw)
        if done.attempts.get(V1) is not None and done.attempts[V1].failed:
            hung = dataclasses.replace(done.attempts[V1], signals=frozenset({Signal.TIMEOUT}))
            done.attempts[V1] = hung
        return done


def test_a_victim_that_hangs_at_a_blocks_end_turns_the_screen_to_pairs(tmp_path: Path) -> None:
    # It would wait out the timeout at every block's end: the chunk is screened again pair
    # by pair, and the cause's other processes pair from the start.
    collected = (P, V1, V2, V3, *PADS)
    store = store_after_runs(tmp_path, [[P, V1, *PADS], [V2, V3, P, *PADS]], collected=collected)
    searches_over(store, host := HangingHost()).run()
    assert store.ev(V2).polluters == store.ev(V3).polluters == [P]
    block, pairs = [seq for kind, seq in host.asked if kind == "pairs"]
    assert block.count(P) == 1 and block[-1] == V1
    assert pairs[0::2] == (P,) * (len(pairs) // 2) and {V2, V3} <= set(pairs[1::2])


def test_a_victim_that_timed_out_in_a_run_is_no_sentinel(tmp_path: Path) -> None:
    collected = (P, V1, V2, V3, *PADS)
    store = store_after_runs(tmp_path, [[P, V1, *PADS], [V2, V3, P, *PADS]], collected=collected)
    store.ev(V1).signals.add(Signal.TIMEOUT)
    searches_over(store, host := ModelHost()).run()
    assert store.ev(V2).polluters == store.ev(V3).polluters == [P]
    (pairs,) = [seq for kind, seq in host.asked if kind == "pairs"]
    assert pairs[0::2] == (P,) * (len(pairs) // 2)


A, B = "u/test_utils.py::test_a", "u/test_utils.py::test_b"  # either, then M, pollutes
M = "d/test_dt.py::test_m"
W = "v/test_v.py::test_w"


def mirrored(sequence: Sequence[str]) -> dict[str, bool]:
    """freezegun's test_utils pair: A or B, then M, pollutes; W fails when polluted, and so
    does each of A and B when the other one, then M, ran before it."""
    failed: dict[str, bool] = {}
    for k, test in enumerate(sequence):
        before = sequence[:k]
        firsts = {t: before.index(t) for t in (A, B) if t in before}
        m_after = {t for t, i in firsts.items() if M in before[i + 1 :]}
        hit = bool(m_after - {test}) if test in (A, B) else bool(m_after) and test == W
        failed[test] = failed.get(test, False) or hit
    return failed


def test_a_polluter_is_tried_as_its_module_mirrors_victim(tmp_path: Path) -> None:
    # W fails after A + M. B, A's module sibling, is a victim of A + M too (pair screen), and
    # A a victim of B + M: with A in the cause, neither screen puts A after a cause; the
    # cause with A replaced by B does.
    collected = (A, B, M, W, *PADS)
    store = store_after_runs(tmp_path, [[B, A, M, W, *PADS], [A, *PADS, W, M]], mirrored,
                             collected)  # fmt: skip
    assert (store.ev(A).failures, store.ev(B).failures, store.ev(W).failures) == (0, 0, 1)
    searches_over(store, ModelHost(mirrored)).run()
    assert store.ev(W).polluters == [A, M]
    assert store.ev(B).polluters == [A, M]
    assert store.ev(A).polluters == [B, M]


def test_a_test_that_left_the_environment_changed_is_screened_as_a_polluter(
    tmp_path: Path,
) -> None:
    # No victim failed in any run (a cleaner always ran between): nothing to search from. P's
    # alone run showed it left a variable set, and that is enough to screen it.
    store = store_after_runs(tmp_path, [[P, CLEAN, V1, V2, V3], [P, CLEAN, *PADS, V3]])
    assert not [n for n in COLLECTED if store.ev(n).failures and n != BRITTLE]
    store.ev(P).signals.add(Signal.ENV_LEAK)
    searches_over(store, host := ModelHost()).run()
    assert store.ev(V1).polluters == store.ev(V2).polluters == store.ev(V3).polluters == [P]
    assert [kind for kind, _ in host.asked].count("pairs") == 1


G0, W3 = "g/test_g.py::test_g0", "g/test_g.py::test_w3"  # W3 fails once G0 ran polluted


def third_polluter(sequence: Sequence[str]) -> dict[str, bool]:
    """`outcomes` plus a module g whose G0, run after P, leaves what W3 fails on; CLEAN
    restores both."""
    polluted, g_set = False, False
    failed: dict[str, bool] = {}
    for test in sequence:
        hit = (test in (V1, V2) and polluted) or (test == W3 and g_set)
        failed[test] = failed.get(test, False) or hit
        g_set = (g_set or (test == G0 and polluted)) and test != CLEAN
        polluted = (polluted or test == P) and test != CLEAN
    return failed


def test_a_repeatable_polluters_pair_screen_is_its_module_screens_too(tmp_path: Path) -> None:
    # Issue 21: the pair screen runs whole modules in their own order, so W3 (which needs
    # G0, of its own module, after P) fails there, and its search starts from what a
    # module screen would have run before it: no module screen repeats the pair screen.
    collected = (P, V1, V2, CLEAN, G0, W3, *PADS)
    runs = [[P, V1, CLEAN, G0, W3, *PADS], [P, CLEAN, G0, W3, V2, PADS[0]]]
    store = store_after_runs(tmp_path, runs, third_polluter, collected)
    assert (store.ev(V1).failures, store.ev(V2).failures, store.ev(W3).failures) == (1, 0, 0)
    searches_over(store, host := ModelHost(third_polluter)).run()
    assert store.ev(V2).polluters == [P]
    assert store.ev(W3).polluters == [P, G0]
    kinds = [kind for kind, _ in host.asked]
    assert kinds.count("pairs") == 4  # P's, then that of P + G0: each a block that CLEAN
    # emptied (its sentinel passed at its end), then the same tests pair by pair
    assert "screen" not in kinds


def not_repeatable(sequence: Sequence[str]) -> dict[str, bool]:
    """`outcomes`, and P fails when it ran before in the same process."""
    failed = outcomes(sequence)
    if sequence.count(P) > 1:
        failed[P] = True
    return failed


def test_a_polluter_that_fails_when_repeated_gets_module_screens(tmp_path: Path) -> None:
    # P X1 P X2 ... cannot be trusted when P fails on its second run: every module the pair
    # screen did not cover is screened with P once before it, and V2 is found there.
    store = store_after_runs(tmp_path, [[P, V1, *PADS], [V2, P, *PADS]], not_repeatable)
    searches_over(store, host := ModelHost(not_repeatable)).run()
    assert store.ev(V2).polluters == [P]
    screened = {seq[1].split("::")[0] for kind, seq in host.asked if kind == "screen"}
    assert {"c/test_c.py", "f/test_f.py"} <= screened  # one-test modules get a trial
    assert any("failed when replayed before each test" in note for note in host.notes)


class RacingHost(ModelHost):
    """Runs the first of two jobs; then, while the second holds its test (its replay of
    `hold` waits), the jobs the first returned, as two pool threads can."""

    def __init__(self, model: Model, hold: tuple[str, ...]) -> None:
        super().__init__(model)
        self.hold = hold
        self.entered, self.release = threading.Event(), threading.Event()

    def replay(
        self, sequence: Sequence[str], *, seed: int | None, kind: str,
        extra: Sequence[str] = (), exclusive: bool = False, group: object = None,
    ) -> Replayed:  # fmt: skip
        if tuple(sequence) == self.hold:
            self.entered.set()
            self.release.wait(10)
        return super().replay(sequence, seed=seed, kind=kind, extra=extra)

    def pool(
        self, desc: str, jobs: Sequence[Any], work: Callable[[Any, int], list[Any]],
        target: Callable[[Any], str | None] | None = None,
    ) -> None:  # fmt: skip
        first, second = jobs
        queue = work(first, 0)
        racer = threading.Thread(target=lambda: queue.extend(work(second, 1)))
        racer.start()
        while racer.is_alive() and not self.entered.wait(0.05):
            pass
        for job in queue[:]:
            queue.remove(job)
            queue += work(job, 2)
        self.release.set()
        racer.join()
        while queue:
            queue += work(queue.pop(0), 3)


def test_a_screen_hit_is_searched_even_while_another_causes_trial_holds_it(
    tmp_path: Path,
) -> None:
    # Two causes' module screens both hit W3 (it needs G0 after P). P's trial does not
    # reproduce it; the search from the screen's prefix must not be lost to the other
    # cause's trial holding W3 at that moment.
    collected = (P, V1, V2, CLEAN, G0, W3, *PADS)
    store = store_after_runs(tmp_path, [[P, V1, CLEAN, G0, W3, *PADS]], third_polluter, collected)
    host = RacingHost(third_polluter, hold=(PADS[0], W3))
    searches = searches_over(store, host)
    searches._screen_prefixes[W3] = (1, [P, G0])
    host.pool("", [("trial", "polluter", P, W3), ("trial", "polluter", PADS[0], W3)],
              searches._job)  # fmt: skip
    assert store.ev(W3).polluters == [P, G0]


def test_a_capture_unsafe_polluter_gets_no_pair_screen(tmp_path: Path) -> None:
    # Issue 20: what a capture-unsafe test leaves depends on a neighbour breaking its
    # capture, which a pair or module screen would replay by chance (on the H200 the
    # CuPy slice's screens of two such tests took most of a 245 s search phase).
    store = store_after_runs(tmp_path, [[P, V1, *PADS], [V2, *PADS, P]])
    unsafe = store.ev(P).capture
    unsafe.capture_failures, unsafe.control_runs = 1, 2
    searches = searches_over(store, host := ModelHost())
    searches.run()
    assert store.ev(V1).polluters == [P]
    assert not [kind for kind, _ in host.asked if kind in ("pairs", "screen")]
    unsafe.capture_failures = 0  # the same cause, not capture-unsafe: screened
    store2 = store_after_runs(tmp_path / "2", [[P, V1, *PADS], [V2, *PADS, P]])
    searches_over(store2, host2 := ModelHost()).run()
    assert [kind for kind, _ in host2.asked if kind == "pairs"]
