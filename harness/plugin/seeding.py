"""Per-test reseeding of every global generator a suite may draw from.

`random` always; numpy's global generator only when the suite already imported
numpy (importing it ourselves would change the process under test and cost
about 100 ms); and every function registered under pytest-randomly's
`pytest_randomly.random_seeder` entry point group, so a generator that already
works with pytest-randomly works here too. A test that imports numpy for the
first time in its own body draws from an unseeded generator in that phase only:
the next phase, and every later test, is reseeded.

Imported by the plugin in every test process that has a seed: stdlib only.
"""

from __future__ import annotations

import functools
import importlib
import random
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "pytest_randomly.random_seeder"
SEED32 = 0xFFFFFFFF

Seeder = Callable[[int], object]


def seed32(seed: int) -> int:
    """`seed` folded to 32 bits (numpy's limit), every 32-bit word of it counting."""
    folded = 0
    while True:
        folded ^= seed & SEED32
        seed >>= 32
        if not seed:
            return folded


@functools.cache
def registered_seeders() -> tuple[tuple[Seeder, ...], tuple[str, ...]]:
    """The functions of the entry point group, and one line per entry point that failed to load.

    Read once per process: importlib.metadata scans every installed distribution for it,
    15-50 ms that a forked replay's first test paid in its setup until the fork server
    read it before forking (harness.sweep.fork_server)."""
    seeders: list[Seeder] = []
    problems: list[str] = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            seeders.append(point.load())
        except Exception as exc:  # a broken third-party seeder: skip it, say so once
            problems.append(f"{ENTRY_POINT_GROUP} entry point {point.value}: {exc}")
    return tuple(seeders), tuple(problems)


class Reseeder:
    """Reseeds `random`, numpy (when imported) and registered seeders from one per-test seed."""

    def __init__(self, seeders: Sequence[Seeder]) -> None:
        self.seeders = seeders

    def __call__(self, seed: int) -> None:
        random.seed(seed)
        small = seed32(seed)
        if "numpy" in sys.modules:
            importlib.import_module("numpy.random").seed(small)
        for seeder in self.seeders:
            seeder(small)
