"""KernelCache: the directory of compiled kernels and its one operation, get_or_compile.

Every failure on the cache path (missing, unreadable, corrupt, symlinked or special
entry; read-only, full or vanished directory; an OS error from any call, close
included; a lock that cannot be had) is a miss that falls through to compiling, with
at most one warning per process: the cache can make a process faster, never make it
fail. Entries are published by rename so a reader sees a whole entry or none.
Several processes that miss the same key at once serialize on a per-key lock: one
compiles, the rest wait and then hit. See docs/kernel_cache.md.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsafe.config import DEFAULT_KERNEL_CACHE_MAX_BYTES
from capsafe.errors import UsageError
from capsafe.kernel_cache import dirs, lock, stats
from capsafe.kernel_cache.format import KINDS, Entry, decode, encode
from capsafe.kernel_cache.key import normalize_key
from capsafe.kernel_cache.once import PROCESS_WARNER, log

DEFAULT_MAX_BYTES = DEFAULT_KERNEL_CACHE_MAX_BYTES
DEFAULT_LOCK_TIMEOUT = 600.0  # a long compile by a live, running holder
_STALE_TEMP_SECONDS = 3600.0
_STATS_FLUSH_SECONDS = 1.0

Compile = Callable[[], tuple[bytes, Mapping[str, Any]]]


@dataclass(frozen=True)
class Lookup:
    """What get_or_compile produced. `hit` is True when the payload came from disk."""

    payload: bytes
    meta: Mapping[str, Any]
    hit: bool
    compile_seconds: float  # what compiling this entry cost (when it was compiled)
    waited: bool = False  # another process compiled it while this one waited


@dataclass(frozen=True)
class EntryInfo:
    key: str
    path: Path
    size: int
    mtime: float
    kind: str | None  # None when the entry is corrupt
    meta: Mapping[str, Any] = field(default_factory=dict)


class KernelCache:
    """A directory of compiled kernels keyed by `cache_key` digests.

    Layout: entries/ab/cd/<digest>, locks/<digest>.lock, stats.json.
    `max_bytes` 0 means unbounded; `enabled` False compiles every time. A relative
    `directory` is made absolute when the instance is made.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        enabled: bool = True,
        *,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        warn: Callable[[str], None] = PROCESS_WARNER,
    ) -> None:
        if max_bytes < 0:
            raise UsageError(f"max_bytes must be >= 0 (0 = unbounded), not {max_bytes}")
        # Resolved once, here, and checked as such by usable(): a relative path must not
        # follow a later chdir into a directory nobody checked (the process-wide cache is
        # built at its first use, from CAPSAFE_KERNEL_CACHE_DIR).
        self.directory = Path(os.path.abspath(directory))
        self.max_bytes = max_bytes
        self.enabled = enabled
        self.lock_timeout = lock_timeout
        self._warn = warn
        self._usable: bool | None = None
        self._mutex = threading.Lock()
        self._pending: dict[str, float] = {}
        self._last_flush = time.monotonic()
        _LIVE.add(self)

    # -- paths --------------------------------------------------------------
    @property
    def entries_dir(self) -> Path:
        return self.directory / "entries"

    def entry_path(self, key: str) -> Path:
        key = normalize_key(key)
        return self.entries_dir / key[:2] / key[2:4] / key

    # -- the one public operation ---------------------------------------------
    def get_or_compile(
        self,
        key: str,
        kind: str,
        compile: Compile,
        *,
        publish_if: Callable[[], bool] | None = None,
    ) -> Lookup:
        """The entry for `key` from disk, else `compile()`'s (payload, meta), published.

        `publish_if`, asked after compiling, can veto publishing (the inputs changed
        while compiling). Compile errors propagate; cache errors never do.
        """
        if kind not in KINDS:
            raise UsageError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        key = normalize_key(key)
        if not self.usable():
            return self._compile(compile)
        found = self._read(key, kind)
        if found is not None:
            self._count(hits=1, saved_seconds=found.compile_seconds)
            return found
        self._count(misses=1)
        with self._key_lock(key):
            found = self._read(key, kind, recheck=True)
            if found is not None:  # another process compiled it while this one waited
                self._count(hits=1, waits=1, saved_seconds=found.compile_seconds)
                return Lookup(found.payload, found.meta, True, found.compile_seconds, waited=True)
            made = self._compile(compile)
            self._count(compiles=1, compile_seconds=made.compile_seconds, flush=False)
            if publish_if is None or publish_if():
                self._write(key, kind, made)
        self._flush_stats(force=True)
        return made

    def _compile(self, compile: Compile) -> Lookup:
        start = time.perf_counter()
        payload, meta = compile()
        return Lookup(bytes(payload), dict(meta), False, time.perf_counter() - start)

    # -- directory checks -------------------------------------------------------
    def usable(self) -> bool:
        """Enabled, and the directory is ours and private (checked once per instance)."""
        if not self.enabled:
            return False
        if self._usable is None:
            problem = self._directory_problem()
            if problem:
                self._warn(problem)
            self._usable = problem is None
        return self._usable

    def _directory_problem(self) -> str | None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            st = os.stat(self.directory)
        except OSError as exc:
            return f"cannot create {self.directory}: {exc.strerror or exc}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{self.directory} is not a directory"
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            return f"{self.directory} is owned by uid {st.st_uid}, not by this user"
        if st.st_mode & 0o022:
            return (
                f"{self.directory} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 700 {self.directory}"
            )
        return None

    def _shard(self, key: str, create: bool) -> contextlib.AbstractContextManager[int]:
        return dirs.opened(self.directory, ("entries", key[:2], key[2:4]), create)

    # -- reading ------------------------------------------------------------------
    def _read(self, key: str, kind: str, recheck: bool = False) -> Lookup | None:
        try:
            shard = dirs.open_path(self.directory, ("entries", key[:2], key[2:4]))
            try:
                data = dirs.read_file(shard, key, touch=True)
            finally:
                with contextlib.suppress(OSError):
                    os.close(shard)
        except FileNotFoundError:
            return None
        except dirs.NotRegularFile as exc:
            self._warn(f"{self.entry_path(key)} is {exc.strerror}; ignored and replaced")
            return None
        except OSError as exc:  # EIO, ESTALE (from close too), ENOTDIR, ELOOP, EACCES...
            self._warn(f"cannot read {self.entry_path(key)}: {exc.strerror or exc}")
            return None
        entry = decode(data)
        if entry is None or entry.kind != kind or entry.key != key:
            if not recheck:  # the same damaged entry seen again under the lock
                self._count(corrupt=1)
            return None
        return Lookup(entry.payload, entry.meta, True, entry.compile_seconds)

    # -- writing --------------------------------------------------------------------
    def _write(self, key: str, kind: str, made: Lookup) -> bool:
        data = encode(Entry(kind, key, made.payload, made.meta, made.compile_seconds))
        temp = stats.temp_name()
        try:
            with self._shard(key, create=True) as shard:
                replaced = dirs.regular_size(shard, key)
                dirs.replace_with(shard, key, temp, data)  # a torn entry fails its checksum
        except OSError as exc:
            self._warn(f"cannot write {self.entry_path(key)}: {exc.strerror or exc}")
            return False
        self._track(len(data) - replaced, key)
        return True

    def _track(self, delta: int, keep: str) -> None:
        """Add the write to the size tracker; evict (one scan) only when over budget."""
        with self._mutex:
            self._pending[stats.TRACKED] = self._pending.get(stats.TRACKED, 0) + delta
        totals = self._flush_stats(force=True)
        if self.max_bytes == 0:
            return
        if totals is None or totals.get(stats.TRACKED, self.max_bytes + 1) > self.max_bytes:
            self.prune(keep=keep)

    # -- single flight ----------------------------------------------------------------
    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Hold the per-key lock if it can be had; without it, compile anyway."""
        with contextlib.ExitStack() as stack:
            try:
                locks = stack.enter_context(dirs.opened(self.directory, ("locks",), True))
                stack.enter_context(lock.held(locks, f"{key}.lock", self.lock_timeout))
            except (OSError, lock.LockUnavailable) as exc:
                self._warn(f"cannot lock {key[:16]}: {exc}")
            yield

    # -- eviction ---------------------------------------------------------------------
    def _walk(self) -> Iterator[dirs.Found]:
        try:
            with dirs.opened(self.directory, ("entries",), create=False) as entries:
                yield from dirs.walk(entries)
        except OSError:
            return

    def entries(self) -> list[EntryInfo]:
        """Every entry on disk (corrupt ones with kind None), least recently used first."""
        found = []
        for f in self._walk():
            if f.temp:
                continue
            try:
                entry = decode(dirs.read_file(f.parent, f.name))
            except OSError:
                entry = None
            found.append(
                EntryInfo(
                    f.name,
                    self.entries_dir / f.shard / f.name,
                    f.st.st_size,
                    f.st.st_mtime,
                    entry.kind if entry and entry.key == f.name else None,
                    dict(entry.meta) if entry and entry.key == f.name else {},
                )
            )
        found.sort(key=lambda e: e.mtime)
        return found

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) currently on disk, temp files included in bytes."""
        count = size = 0
        for f in self._walk():
            size += f.st.st_size
            count += not f.temp
        return count, size

    def prune(self, max_bytes: int | None = None, keep: str | None = None) -> tuple[int, int]:
        """Delete least-recently-used entries until the total fits `max_bytes`.

        `max_bytes` defaults to the budget; 0 means unbounded (nothing evicted).
        `keep` (the key just written) survives even if it alone exceeds the budget,
        so the lookup that wrote it hits next time. Stale temp files of crashed
        writers go too. Resets the size tracker from what it counted.
        Returns (entries removed, bytes freed).
        """
        budget = self.max_bytes if max_bytes is None else max_bytes
        try:
            with stats.locked(self.directory) as root:  # no tracker update races the scan
                removed, freed, left = self._evict(budget, keep)
                stats.merge(root, {}, set_bytes=left)
        except lock.LockUnavailable as exc:  # another process holds it: it prunes or counts
            self._warn(f"cannot prune {self.directory}: {exc}")
            return 0, 0
        except OSError as exc:
            # No statistics lock to be had (even after lock.held replaced a FIFO, symlink or
            # directory at its name): say so, and keep the budget anyway, unlocked. The
            # tracker stays unknown, so every write scans until the lock works again.
            self._warn(f"cannot lock {self.directory}'s statistics ({exc}); pruning unlocked")
            try:
                removed, freed, _left = self._evict(budget, keep)
            except OSError:
                return 0, 0
        return removed, freed

    def _evict(self, budget: int, keep: str | None) -> tuple[int, int, int]:
        now = time.time()
        live: list[tuple[int, int, str]] = []
        total = removed = freed = 0
        with contextlib.ExitStack() as stack:
            try:
                entries = stack.enter_context(dirs.opened(self.directory, ("entries",), False))
            except FileNotFoundError:
                return 0, 0, 0  # nothing cached yet
            for f in dirs.walk(entries):
                if f.temp:
                    if now - f.st.st_mtime > _STALE_TEMP_SECONDS:
                        with contextlib.suppress(OSError):
                            os.unlink(f.name, dir_fd=f.parent)
                    else:
                        total += f.st.st_size
                    continue
                total += f.st.st_size
                if budget and f.name != keep:
                    live.append((f.st.st_mtime_ns, f.st.st_size, f.name))
            if budget == 0 or total <= budget:
                return 0, 0, total
            live.sort()
            for _mtime, size, name in live:  # the walk has closed their directories: reopen
                if total <= budget:
                    break
                try:
                    with self._shard(name, create=False) as shard:
                        os.unlink(name, dir_fd=shard)
                except FileNotFoundError:
                    pass  # another process pruned it first
                except OSError as exc:
                    self._warn(f"cannot prune {name[:16]}: {exc.strerror or exc}")
                    break
                else:
                    removed += 1
                    freed += size
                total -= size
        return removed, freed, total

    def clear(self) -> int:
        """Remove every entry, lock and the statistics; returns the entries removed."""
        count = 0
        for f in self._walk():
            with contextlib.suppress(OSError):
                os.unlink(f.name, dir_fd=f.parent)
                count += not f.temp
        try:
            with dirs.opened(self.directory, (), create=False) as root:
                with contextlib.suppress(OSError):
                    os.unlink(stats.FILE, dir_fd=root)
                locks = dirs.open_dir(root, "locks", create=False)
                try:
                    for name in os.listdir(locks):
                        if name == stats.LOCK or dirs.LOCK_NAME.fullmatch(name):
                            with contextlib.suppress(OSError):
                                os.unlink(name, dir_fd=locks)
                finally:
                    os.close(locks)
        except OSError:
            pass
        with self._mutex:
            self._pending.clear()
        return count

    # -- statistics -----------------------------------------------------------------------
    def _count(self, flush: bool = True, **amounts: float) -> None:
        with self._mutex:
            for name, amount in amounts.items():
                self._pending[name] = self._pending.get(name, 0) + amount
        if flush:
            self._flush_stats(force=False)

    def stats(self) -> dict[str, float]:
        """Counters summed over every process that used this directory."""
        self._flush_stats(force=True)
        totals: dict[str, float] = {name: 0 for name in stats.COUNTERS}
        try:
            with dirs.opened(self.directory, (), create=False) as root:
                saved = stats.load(root)
        except OSError:
            saved = {}
        totals.update({k: v for k, v in saved.items() if k in stats.COUNTERS})
        with self._mutex:  # whatever could not be flushed yet still counts
            for name, amount in self._pending.items():
                if name in stats.COUNTERS:
                    totals[name] = totals.get(name, 0) + amount
        return totals

    def _flush_stats(self, force: bool) -> dict[str, float] | None:
        """Merge this process's pending counters into stats.json; the totals, None on failure.

        Hits are batched (at most one flush a second) so the hit path stays a read;
        compiles flush at once; atexit flushes the rest.
        """
        with self._mutex:
            if not self._pending or not self.usable():
                return None
            if not force and time.monotonic() - self._last_flush < _STATS_FLUSH_SECONDS:
                return None
            pending, self._pending = self._pending, {}
            self._last_flush = time.monotonic()
        try:
            if not self.directory.is_dir():
                return None  # removed under us (a temporary directory at exit): never recreate it
            with stats.locked(self.directory) as root:
                return stats.merge(root, pending)
        except Exception as exc:  # OSError, LockUnavailable: keep the counts for later
            with self._mutex:
                for name, amount in pending.items():
                    self._pending[name] = self._pending.get(name, 0) + amount
            log.debug("capsafe kernel cache: statistics not saved: %s", exc)
            return None

    def _reset_after_fork(self) -> None:
        self._mutex = threading.Lock()
        self._pending = {}  # the parent flushes its own counts


_LIVE: weakref.WeakSet[KernelCache] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for cache in list(_LIVE):
        with contextlib.suppress(Exception):
            cache._flush_stats(force=True)
