"""Coexisting with pytest-randomly: capsafe's seed drives it, so a seed still fixes the order
and the `random` stream.

pytest-randomly, where installed, reorders the tests with a seed of its own before any
other plugin (capsafe's shuffle starts from the order it is given, so a different start
is a different order) and reseeds `random` at every test phase after capsafe has (its
hooks run later), each run with a fresh seed unless told one. Neither the order nor the
stream would follow capsafe's seed, and nothing would say so.

So wherever capsafe orders the tests (a seed, a shuffle or a replay), it sets
pytest-randomly's own options: no reordering (`--randomly-dont-reorganize`: capsafe's
order, or the replay's, is the order); and with a seed, no per-test reseeding
(`--randomly-dont-reset-seed`: capsafe reseeds `random`, numpy and the same
`pytest_randomly.random_seeder` entry points itself, harness.plugin.seeding) and
`--randomly-seed` the run's seed, so what pytest-randomly still seeds (once at session
start, and the per-test faker seed of its fixture) follows capsafe's seed too. The same
seed then gives the same order and the same `random` stream with and without
pytest-randomly installed. The collection process keeps the project's own order the
same way. The header line and the sweep's report say so.
"""

from __future__ import annotations

import pytest

PLUGIN = "randomly"  # pytest-randomly's pytest11 entry point name
NOTE = (
    "pytest-randomly is installed: in the sweep's processes capsafe's seed drives it "
    "(--randomly-seed is each run's seed; its reordering and per-test reseeding are off, "
    "capsafe's order and reseeding in their place), so a seed still fixes the order and "
    "the random stream"
)


def installed(config: pytest.Config) -> bool:
    """pytest-randomly is loaded in this pytest (installed, and not `-p no:randomly`)."""
    return config.pluginmanager.has_plugin(PLUGIN)


def keep_order(config: pytest.Config) -> bool:
    """Stop pytest-randomly reordering the tests; whether it is loaded here."""
    if not installed(config):
        return False
    config.option.randomly_reorganize = False
    return True


def take_over(config: pytest.Config, seed: int | None) -> str:
    """pytest-randomly's options set from capsafe's order and seed; the header's words for
    it ("" where it is not loaded)."""
    if not keep_order(config):
        return ""
    if seed is None:
        return "pytest-randomly: reordering off (capsafe's order)"
    config.option.randomly_reset_seed = False
    config.option.randomly_seed = seed
    return f"pytest-randomly: seed {seed}, reordering and per-test reseeding off (capsafe's)"
