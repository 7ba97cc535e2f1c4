"""Cache keys: sha256 hex digests over length-prefixed fields."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from capsafe.errors import UsageError
from capsafe.kernel_cache.format import FORMAT_VERSION

DIGEST = re.compile(r"[0-9a-f]{64}")


def cache_key(fields: Iterable[bytes | str]) -> str:
    """A stable hex digest over length-prefixed fields, led by the cache format version.

    Length prefixes keep ("ab", "c") and ("a", "bc") apart; sha256 (not hash())
    keeps the key identical across processes, Python versions and machines.
    """
    h = hashlib.sha256()
    for item in (b"capsafe-kernel-cache", str(FORMAT_VERSION), *fields):
        data = item.encode() if isinstance(item, str) else bytes(item)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def normalize_key(key: str) -> str:
    """`key` in lower case; a UsageError, before anything compiles, unless it is a digest."""
    lowered = key.lower() if isinstance(key, str) else ""
    if not DIGEST.fullmatch(lowered):
        raise UsageError(f"a cache key is 64 hex digits (a cache_key digest), not {key!r}")
    return lowered
