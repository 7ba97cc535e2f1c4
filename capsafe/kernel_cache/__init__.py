"""On-disk cache of compiled kernels: never load-bearing, bounded, single-flight across processes.

key: how keys are formed; includes: what NVRTC will read, resolved once; format: the
entry file; dirs: symlink- and FIFO-safe access; lock: bounded cross-process locks;
stats: counters and the size tracker; store: KernelCache; cli: `capsafe cache`.
See docs/kernel_cache.md.
"""

from __future__ import annotations

import os  # noqa: F401  (tests reach the os module as kernel_cache.os)

from capsafe import _state
from capsafe.kernel_cache import lock, settings
from capsafe.kernel_cache.format import FORMAT_VERSION, HEADER_SIZE, KINDS, MAGIC
from capsafe.kernel_cache.key import cache_key, normalize_key
from capsafe.kernel_cache.once import PROCESS_WARNER, OnceWarner
from capsafe.kernel_cache.settings import (
    CacheSettings,
    default_cache,
    default_directory,
    settings_from_env,
)
from capsafe.kernel_cache.store import (
    _LIVE,
    DEFAULT_MAX_BYTES,
    EntryInfo,
    KernelCache,
    Lookup,
    _flush_all,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KINDS",
    "MAGIC",
    "PROCESS_WARNER",
    "CacheSettings",
    "EntryInfo",
    "KernelCache",
    "Lookup",
    "OnceWarner",
    "_flush_all",
    "cache_key",
    "default_cache",
    "default_directory",
    "normalize_key",
    "settings_from_env",
]


@_state.on_fork
def _reset_after_fork() -> None:
    """A forked child starts with fresh locks: another parent thread may have held one."""
    for cache in list(_LIVE):
        cache._reset_after_fork()
    PROCESS_WARNER.reset_after_fork()
    settings.reset_after_fork()
    lock.reset_after_fork()
    from capsafe.kernel_cache import includes

    includes.reset_after_fork()
