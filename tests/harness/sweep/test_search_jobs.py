"""Which tests the cause searches take: none where the evidence already decides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from capsafe_harness.sweep.capture_sweep import CapturePhases
from capsafe_harness.sweep.searches import Searches
from capsafe_harness.sweep.store import EvidenceStore


def test_a_test_that_failed_everywhere_gets_no_state_setter_search(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, 60.0)
    # Failed every suite run and every rerun alone (a test that needs a second GPU):
    # no passing sequence exists to search, its verdict is `fail` already.
    everywhere = store.ev("t.py::needs_two_gpus")
    everywhere.runs = everywhere.failures = everywhere.isolation_runs = 3
    everywhere.isolation_failures = 3
    # Failed alone every time but passed in a suite run: a state-setter may explain it.
    brittle = store.ev("t.py::brittle")
    brittle.runs, brittle.failures, brittle.isolation_runs, brittle.isolation_failures = 3, 2, 3, 3
    victim = store.ev("t.py::victim")
    victim.runs, victim.failures, victim.isolation_runs = 3, 1, 3
    nothing = cast(Any, None)  # jobs() reads the store alone
    searches = Searches(nothing, store, CapturePhases(0, store=store.evidence), nothing, nothing)
    assert searches.jobs() == [("state-setter", "t.py::brittle"), ("polluter", "t.py::victim")]
