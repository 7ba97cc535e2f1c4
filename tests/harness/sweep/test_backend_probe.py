"""The report's backend is the one the test processes resolve, never the request `auto`."""

from __future__ import annotations

import os

from capsafe_harness.sweep.backend_probe import backend_in_tests


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSAFE_")}
    return {**env, **extra}


def test_auto_is_resolved_to_the_backend_a_test_process_takes() -> None:
    choice = backend_in_tests(_env())
    assert choice.startswith(("sim (auto: ", "cuda (auto: ")), choice


def test_a_forced_backend_says_so() -> None:
    assert backend_in_tests(_env(CAPSAFE_BACKEND="sim")) == "sim (sim requested)"


def test_a_probe_that_fails_says_what_was_requested_and_why() -> None:
    choice = backend_in_tests(_env(CAPSAFE_BACKEND="bogus"))
    assert choice.startswith("bogus (not resolved: ") and "CAPSAFE_BACKEND" in choice, choice
