"""Which part of a sweep shard K of N does (`capsafe sweep --shard K/N`).

Order-dependence evidence needs whole-suite runs: a polluter and its victim must be
able to meet. So a shard never runs a subset of the suite in one run; the suite runs
are dealt out instead (shard K does run k when (k - 1) % N == K - 1, with run k's seed
whichever shard does it), and so are the alone reruns, by test: a failing test's reruns
are done by the shard its stable hash (the node id with the sweep seed) names, if that
shard saw it fail. `capsafe merge` (harness.sweep.merge) does the rest with every shard's view.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def stable_hash(seed: int, *parts: object) -> int:
    """A 32-bit hash of the parts under the sweep seed: the same on every machine and run."""
    text = ":".join(["capsafe", str(seed), *(str(p) for p in parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


@dataclass(frozen=True)
class Shard:
    """Shard `index` (1-based) of `count`."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def runs(self, total: int) -> list[int]:
        """The suite runs (1-based) this shard does, of `total`."""
        return [k for k in range(1, total + 1) if (k - 1) % self.count == self.index - 1]

    def owns(self, nodeid: str, seed: int) -> bool:
        """Whether this shard does the alone reruns of `nodeid` (when it saw it fail)."""
        return bucket(nodeid, seed, self.count) == self.index


def bucket(nodeid: str, seed: int, count: int) -> int:
    """The shard (1-based, of `count`) that reruns `nodeid` alone."""
    return stable_hash(seed, "shard", nodeid) % count + 1


def parse_shard(text: str) -> Shard:
    """`K/N` with 1 <= K <= N; ValueError with a one-line reason otherwise."""
    index, sep, count = text.partition("/")
    try:
        shard = Shard(int(index), int(count))
    except ValueError:
        shard = None
    if not sep or shard is None or not 1 <= shard.index <= shard.count:
        raise ValueError(f"--shard must be K/N with 1 <= K <= N, got {text!r}")
    return shard
