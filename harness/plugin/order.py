"""Reproducible test order: seeded shuffles, per-test reseeding, and replay lists.

Every xdist worker collects the same items in the same order and shuffles them
with the same seed, so every worker computes the identical order (xdist refuses
to run when workers disagree). Shuffling only needs the node ids, so everything
here works on plain strings and is tested without pytest.
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

SHUFFLE_MODES = ("global", "module", "none")
SEED_BITS = 32


def module_of(nodeid: str) -> str:
    """The file part of a node id: the bucket `module` shuffling keeps together."""
    return nodeid.split("::", 1)[0]


def class_of(nodeid: str) -> str:
    """The node id without its last part: the module, or the class, a test lives in."""
    return nodeid.rsplit("::", 1)[0] if "::" in nodeid else nodeid


def _buckets(items: Sequence[T], key: Callable[[T], str]) -> list[list[T]]:
    found: dict[str, list[T]] = {}
    for item in items:
        found.setdefault(key(item), []).append(item)
    return list(found.values())


def shuffled(items: Sequence[T], seed: int, mode: str, nodeid: Callable[[T], str] = str) -> list[T]:
    """`items` in the order `mode` gives for `seed`.

    global: one shuffle of everything. module: bucketed as pytest-randomly does, the
    modules in shuffled order, in each the classes (and module-level tests) in shuffled
    order, in each its tests shuffled; so module- and class-scoped fixtures are set up
    once, as in the project's own order. none: unchanged.
    """
    if mode == "none":
        return list(items)
    rng = random.Random(seed)
    if mode == "global":
        everything = list(items)
        rng.shuffle(everything)
        return everything
    if mode != "module":
        raise ValueError(f"unknown shuffle mode {mode!r}; use one of: {', '.join(SHUFFLE_MODES)}")
    modules = _buckets(items, lambda item: module_of(nodeid(item)))
    rng.shuffle(modules)
    out: list[T] = []
    for module in modules:
        classes = _buckets(module, lambda item: class_of(nodeid(item)))
        rng.shuffle(classes)
        for group in classes:
            rng.shuffle(group)
            out.extend(group)
    return out


def per_test_seed(seed: int, nodeid: str) -> int:
    """The `random` seed for one test: fixed by (run seed, node id), independent of order."""
    return (seed << SEED_BITS) ^ zlib.crc32(nodeid.encode("utf-8"))


def parse_seed(text: str) -> int:
    """An explicit seed ("123") or a fresh one for "random"; ValueError otherwise."""
    if text.strip().lower() == "random":
        return int.from_bytes(os.urandom(4), "big")
    seed = int(text)
    if seed < 0:
        raise ValueError("a seed is a non-negative integer")
    return seed


def read_replay(path: str | os.PathLike[str]) -> list[str]:
    """Node ids from a replay file: one per line; blank lines and '#' comments ignored."""
    with open(path, encoding="utf-8") as f:
        lines = (line.strip() for line in f)
        return [line for line in lines if line and not line.startswith("#")]


def write_replay(path: str | os.PathLike[str], nodeids: Sequence[str]) -> None:
    """Write a replay file `read_replay` (and so `--capsafe-replay`) reads back."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(f"{nodeid}\n" for nodeid in nodeids))


def replay_order(
    items: Sequence[T], wanted: Sequence[str], nodeid: Callable[[T], str] = str
) -> tuple[list[T], list[str]]:
    """The items named by `wanted`, in its order (repeats included), and the ids not found."""
    by_id = {nodeid(item): item for item in items}
    missing = [n for n in wanted if n not in by_id]
    return [by_id[n] for n in wanted if n in by_id], missing
