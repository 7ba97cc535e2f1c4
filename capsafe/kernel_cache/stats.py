"""stats.json: counters summed over every process, and the tracked size of entries/.

`bytes` is an incremental tracker: each write adds what it changed, each eviction
sets it from a scan. So a write costs one small locked read-modify-write, not a
directory scan, however many entries there are.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
from collections.abc import Iterator, Mapping

from capsafe.kernel_cache import dirs, lock

COUNTERS = ("hits", "misses", "compiles", "waits", "corrupt", "compile_seconds", "saved_seconds")
TRACKED = "bytes"
FILE = "stats.json"
LOCK = "stats.lock"
LOCK_TIMEOUT = 5.0


def temp_name() -> str:
    return f".tmp-{os.getpid()}-{secrets.token_hex(8)}"


def load(root: int) -> dict[str, float]:
    """The saved values; a missing or corrupt file counts as zero (and is overwritten).

    Only finite, non-negative numbers count: a NaN never gets in, so it never sticks.
    """
    try:
        raw = json.loads(dirs.read_file(root, FILE))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {
        k: float(v) if isinstance(v, float) else v
        for k, v in raw.items()
        if k in (*COUNTERS, TRACKED)
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and v >= 0
    }


@contextlib.contextmanager
def locked(directory: str | os.PathLike[str]) -> Iterator[int]:
    """The cache root's descriptor, with the statistics lock held for the block.

    Raises OSError or lock.LockUnavailable.
    """
    with dirs.opened(directory, (), create=False) as root:
        locks = dirs.open_dir(root, "locks", create=True)
        try:
            with lock.held(locks, LOCK, LOCK_TIMEOUT):
                yield root
        finally:
            with contextlib.suppress(OSError):
                os.close(locks)


def merge(
    root: int, pending: Mapping[str, float], set_bytes: int | None = None
) -> dict[str, float]:
    """Add `pending` to stats.json (or set the tracker); the new totals. Hold `locked`.

    The totals lack TRACKED while no eviction scan has counted the entries.
    """
    totals = load(root)
    for name, amount in pending.items():
        if name == TRACKED and TRACKED not in totals:
            continue  # unknown until a scan counts it: adding a delta to nothing would lie
        totals[name] = max(totals.get(name, 0) + amount, 0)
    if set_bytes is not None:
        totals[TRACKED] = set_bytes
    dirs.replace_with(root, FILE, temp_name(), json.dumps(totals, sort_keys=True).encode())
    return totals
