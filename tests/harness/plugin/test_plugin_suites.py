"""The planted suites: well-formed answer keys that name tests the suites really have."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capsafe_harness.plugin.order import shuffled
from capsafe_harness.records import Signal
from capsafe_harness.verdicts import catalogue

SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"
NAMES = sorted(p.name for p in SUITES.iterdir() if (p / "answer_key.json").exists())
CLASSES = set(catalogue.CLASSES)
SIGNALS = set(Signal)  # the one enum of signal names


@functools.cache
def collect(suite: Path) -> list[str]:
    # Plugins off: collection alone needs none, and start-up is most of the cost.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q"],
        cwd=suite, env=env, capture_output=True, text=True, timeout=240, check=True,
    ).stdout  # fmt: skip
    return [line for line in out.splitlines() if "::" in line]


def test_every_defect_has_a_suite() -> None:
    assert set(NAMES) == {
        "brittle", "brittle_setters", "capture", "capture_leak", "capture_library_error",
        "capture_polluter", "cleaners", "collisions", "crash", "cuda_core_capture", "flaky",
        "frozen_config", "hang", "hidden_victims", "import_once", "leftover_file",
        "neighbour_state", "ordinary", "polluter", "shared_dir",
        # issue 25, `capsafe sweep --fix` (tests/harness/fix/test_fix_end_to_end.py)
        "fix_attribute", "fix_brittle", "fix_cleaner", "fix_env", "fix_registry",
    }  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_answer_key_names_collected_tests(name: str) -> None:
    suite = SUITES / name
    assert (suite / "pytest.ini").exists()
    key = json.loads((suite / "answer_key.json").read_text())
    assert key["default"] == "pass" and set(key["sweep"]) >= {"runs", "workers", "seed"}
    ids = collect(suite)
    assert len(ids) >= (300 if name == "ordinary" else 2)
    for nodeid, expect in key["tests"].items():
        assert nodeid in ids
        assert expect["classification"] in CLASSES and set(expect["signals"]) <= SIGNALS
        assert set(expect["polluters"]) | set(expect["state_setters"]) <= set(ids) - {nodeid}
        assert bool(expect["polluters"]) == (expect["classification"] == "order-dependent")
        assert bool(expect["state_setters"]) == (expect["classification"] == "brittle")
        partners = set(expect.get("collides_with", []))
        assert partners <= set(ids) - {nodeid}
        assert not partners or expect["classification"] == "parallel-unsafe"
        cleaners = set(expect.get("cleaners", []))  # the fix suites' (issue 25)
        assert cleaners <= set(ids) - {nodeid} - set(expect["polluters"])
        assert expect.get("fix_source", "idiom") in ("idiom", "cleaner", "state-setter")


@pytest.mark.parametrize("name", ["polluter", "brittle", "frozen_config", "leftover_file"])
def test_key_sweep_puts_the_cause_first_in_some_run(name: str) -> None:
    """With the key's sweep settings (one process per run), at least one run orders the
    polluter or state-setter before its test, so the key's answer is reachable."""
    from capsafe_harness.sweep.runs import run_seeds

    suite = SUITES / name
    key = json.loads((suite / "answer_key.json").read_text())
    ((nodeid, expect),) = key["tests"].items()
    (cause,) = expect["polluters"] or expect["state_setters"]
    assert key["sweep"]["workers"] == 0
    ids = collect(suite)
    orders = [
        shuffled(ids, s, "global") for s in run_seeds(key["sweep"]["seed"], key["sweep"]["runs"])
    ]
    assert any(o.index(cause) < o.index(nodeid) for o in orders)
