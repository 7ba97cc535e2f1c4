"""On-disk cache of compiled kernels: never load-bearing, bounded, single-flight across processes.

Every failure on the cache path (missing, unreadable, corrupt or symlinked
entry; read-only, full or vanished directory; a lock that cannot be taken) is a
miss that falls through to compiling, with at most one warning per process: the
cache can make a process faster, never make it fail. Entries are published by
rename so a reader sees a whole entry or none, and carry a checksum so a torn or
flipped entry is detected and replaced. Several processes that miss the same key
at once (xdist workers starting cold) serialize on a per-key OS file lock: one
compiles, the rest wait and then hit. See docs/kernel_cache.md.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsafe.config import DEFAULT_KERNEL_CACHE_MAX_BYTES, RuntimeConfig, runtime_config
from capsafe.errors import UsageError

FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = DEFAULT_KERNEL_CACHE_MAX_BYTES
KINDS = {"ptx": 1, "cubin": 2}
MAGIC = b"CSKC"
# magic, format version, kind, meta length, payload length, compile seconds, key, checksum
_HEADER = struct.Struct("<4sHBxIQd32s32s")
HEADER_SIZE = _HEADER.size
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_STALE_TEMP_SECONDS = 3600.0
_STATS_FLUSH_SECONDS = 1.0
_COUNTERS = ("hits", "misses", "compiles", "waits", "corrupt", "compile_seconds", "saved_seconds")

log = logging.getLogger("capsafe.kernel_cache")


class OnceWarner:
    """Logs the first cache problem as a warning and later ones at debug level.

    logging, not warnings.warn: under `-W error` or pytest's filterwarnings=error
    a warning becomes an exception, which would make the cache load-bearing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.warned = False

    def __call__(self, message: str) -> None:
        with self._lock:
            first, self.warned = not self.warned, True
        if first:
            log.warning("capsafe kernel cache: %s; compiling without the cache", message)
        else:
            log.debug("capsafe kernel cache: %s", message)


PROCESS_WARNER = OnceWarner()


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


@dataclass(frozen=True)
class CacheSettings:
    directory: Path
    max_bytes: int
    enabled: bool


def default_directory(environ: Mapping[str, str] | None = None) -> Path:
    """$XDG_CACHE_HOME/capsafe/nvrtc (~/.cache on Linux by XDG default), else the platform's."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "capsafe" / "nvrtc"
    if sys.platform.startswith("linux"):
        return Path.home() / ".cache" / "capsafe" / "nvrtc"
    import platformdirs  # imported lazily: only needed off Linux

    return Path(platformdirs.user_cache_dir("capsafe", appauthor=False)) / "nvrtc"


def settings_from_env(environ: Mapping[str, str] | None = None) -> CacheSettings:
    """Cache settings from the frozen runtime config (or from `environ`, for tests and tools)."""
    config = runtime_config() if environ is None else RuntimeConfig.from_environ(environ)
    directory = config.kernel_cache_dir or default_directory(environ)
    return CacheSettings(
        directory.expanduser(), config.kernel_cache_max_bytes, config.kernel_cache_enabled
    )


_default: KernelCache | None = None
_default_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache built from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            s = settings_from_env()
            _default = KernelCache(s.directory, s.max_bytes, s.enabled)
        return _default


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


def _file_lock(path: Path, timeout: float):
    """A cross-process lock on `path` (filelock: OS locks that die with their holder)."""
    import filelock  # imported lazily: a missing filelock costs single flight, not the cache

    return filelock.FileLock(str(path), timeout=timeout)


class KernelCache:
    """A directory of compiled kernels keyed by `cache_key` digests.

    Layout: entries/ab/cd/<digest>, locks/<digest>.lock, stats.json.
    `max_bytes` 0 means unbounded; `enabled` False compiles every time.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        enabled: bool = True,
        *,
        lock_timeout: float = 600.0,
        warn: Callable[[str], None] = PROCESS_WARNER,
    ) -> None:
        if max_bytes < 0:
            raise UsageError(f"max_bytes must be >= 0 (0 = unbounded), not {max_bytes}")
        self.directory = Path(directory)
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
        return self.entries_dir / key[:2] / key[2:4] / key

    def _temp_name(self) -> str:
        return f".tmp-{os.getpid()}-{secrets.token_hex(8)}"

    # -- the one public operation ---------------------------------------------
    def get_or_compile(
        self, key: str, kind: str, compile: Callable[[], tuple[bytes, Mapping[str, Any]]]
    ) -> Lookup:
        """The entry for `key` from disk, else `compile()`'s (payload, meta), published.

        Compile errors propagate; cache errors never do.
        """
        if kind not in KINDS:
            raise UsageError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
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
            self._count(compiles=1, compile_seconds=made.compile_seconds)
            self._write(key, kind, made)
        self._flush_stats(force=True)
        return made

    def _compile(self, compile: Callable[[], tuple[bytes, Mapping[str, Any]]]) -> Lookup:
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

    # -- reading ------------------------------------------------------------------
    def _read(self, key: str, kind: str, recheck: bool = False) -> Lookup | None:
        path = self.entry_path(key)
        try:
            fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._warn(f"{path} is a symlink; ignored and replaced")
            else:
                self._warn(f"cannot read {path}: {exc.strerror or exc}")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            data = _read_all(fd, st.st_size)
            found = _decode(data, key, kind)
            if found is None:
                if not recheck:  # the same damaged entry seen again under the lock
                    self._count(corrupt=1)
                return None
            with contextlib.suppress(OSError):
                os.utime(fd)  # a hit is a use: LRU eviction goes by mtime
            return found
        except OSError as exc:
            self._warn(f"cannot read {path}: {exc.strerror or exc}")
            return None
        finally:
            os.close(fd)

    # -- writing --------------------------------------------------------------------
    def _write(self, key: str, kind: str, made: Lookup) -> bool:
        path = self.entry_path(key)
        data = _encode(key, kind, made)
        temp: Path | None = None
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            os.makedirs(path.parent, mode=0o700, exist_ok=True)
            candidate = path.parent / self._temp_name()
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
            fd = os.open(candidate, flags, 0o600)
            temp = candidate
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
            # No fsync: a crash can at worst leave a torn entry, which the checksum turns
            # into a miss; fsync would cost milliseconds per entry on every cold start.
            os.replace(temp, path)  # replaces a planted symlink itself, never its target
            temp = None
        except OSError as exc:
            self._warn(f"cannot write {path}: {exc.strerror or exc}")
            return False
        finally:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
        self.prune(keep=path)
        return True

    # -- single flight ----------------------------------------------------------------
    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Hold the per-key lock if it can be had; without it, compile anyway."""
        lock = None
        try:
            locks = self.directory / "locks"
            os.makedirs(locks, mode=0o700, exist_ok=True)
            lock = _file_lock(locks / f"{key}.lock", self.lock_timeout)
            lock.acquire()
        except ImportError:
            self._warn("filelock is not installed, so concurrent misses each compile")
            lock = None
        except Exception as exc:  # OSError, filelock.Timeout: the lock is an optimization
            self._warn(f"cannot lock {key[:16]}: {exc}")
            lock = None
        try:
            yield
        finally:
            if lock is not None:
                with contextlib.suppress(Exception):
                    lock.release()

    # -- eviction ---------------------------------------------------------------------
    def entries(self) -> list[EntryInfo]:
        """Every entry on disk (corrupt ones with kind None), least recently used first."""
        found = []
        for path, st in self._scan():
            if path.name.startswith(".tmp-"):
                continue
            info = _describe(path)
            found.append(
                EntryInfo(
                    path.name,
                    path,
                    st.st_size,
                    st.st_mtime,
                    info[0] if info else None,
                    info[1] if info else {},
                )
            )
        found.sort(key=lambda e: e.mtime)
        return found

    def _scan(self) -> Iterator[tuple[Path, os.stat_result]]:
        for top in _subdirs(self.entries_dir):
            for mid in _subdirs(top):
                try:
                    names = os.listdir(mid)
                except OSError:
                    continue
                for name in names:
                    path = mid / name
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                        yield path, st

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) currently on disk, temp files included in bytes."""
        count = size = 0
        for path, st in self._scan():
            size += st.st_size
            count += not path.name.startswith(".tmp-")
        return count, size

    def prune(self, max_bytes: int | None = None, keep: Path | None = None) -> tuple[int, int]:
        """Delete least-recently-used entries until the total fits `max_bytes`.

        `max_bytes` defaults to the budget; 0 means unbounded (nothing evicted).
        `keep` (the entry just written) survives even if it alone exceeds the
        budget, so the lookup that wrote it hits next time. Stale temp files of
        crashed writers go too. Returns (entries removed, bytes freed).
        """
        budget = self.max_bytes if max_bytes is None else max_bytes
        now = time.time()
        live: list[tuple[int, int, Path]] = []
        total = removed = freed = 0
        for path, st in self._scan():
            if path.name.startswith(".tmp-") and now - st.st_mtime > _STALE_TEMP_SECONDS:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            total += st.st_size
            if not path.name.startswith(".tmp-"):
                live.append((st.st_mtime_ns, st.st_size, path))
        if budget == 0 or total <= budget:
            return 0, 0
        live.sort()
        for _mtime, size, path in live:
            if total <= budget:
                break
            if path == keep:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another process pruned it first
            except OSError as exc:
                self._warn(f"cannot prune {path}: {exc.strerror or exc}")
                break
            else:
                removed += 1
                freed += size
            total -= size
        return removed, freed

    def clear(self) -> int:
        """Remove every entry, lock and the statistics; returns the entries removed."""
        count, _ = self.usage()
        for sub in ("entries", "locks"):
            shutil.rmtree(self.directory / sub, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / "stats.json")
        with self._mutex:
            self._pending.clear()
        return count

    # -- statistics -----------------------------------------------------------------------
    def _count(self, **amounts: float) -> None:
        with self._mutex:
            for name, amount in amounts.items():
                self._pending[name] = self._pending.get(name, 0) + amount
        self._flush_stats(force=False)

    def stats(self) -> dict[str, float]:
        """Counters summed over every process that used this directory."""
        self._flush_stats(force=True)
        totals = {name: 0 for name in _COUNTERS}
        totals.update(_load_stats(self.directory / "stats.json"))
        with self._mutex:  # whatever could not be flushed yet still counts
            for name, amount in self._pending.items():
                totals[name] = totals.get(name, 0) + amount
        return totals

    def _flush_stats(self, force: bool) -> None:
        """Merge this process's pending counters into stats.json under a lock.

        Hits are batched (at most one flush a second) so the hit path stays a read;
        compiles flush at once; atexit flushes the rest.
        """
        with self._mutex:
            if not self._pending or not self.usable():
                return
            if not force and time.monotonic() - self._last_flush < _STATS_FLUSH_SECONDS:
                return
            pending, self._pending = self._pending, {}
            self._last_flush = time.monotonic()
        if not self.directory.is_dir():
            return  # removed under us (a temporary directory at exit): never recreate it
        try:
            os.makedirs(self.directory / "locks", mode=0o700, exist_ok=True)
            with _file_lock(self.directory / "locks" / "stats.lock", 5.0):
                path = self.directory / "stats.json"
                totals = _load_stats(path)
                for name, amount in pending.items():
                    totals[name] = totals.get(name, 0) + amount
                temp = self.directory / self._temp_name()
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
                fd = os.open(temp, flags, 0o600)
                try:
                    _write_all(fd, json.dumps(totals, sort_keys=True).encode())
                finally:
                    os.close(fd)
                try:
                    os.replace(temp, path)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(temp)
                    raise
        except Exception as exc:  # ImportError, OSError, filelock.Timeout
            with self._mutex:
                for name, amount in pending.items():
                    self._pending[name] = self._pending.get(name, 0) + amount
            log.debug("capsafe kernel cache: statistics not saved: %s", exc)


_LIVE: weakref.WeakSet[KernelCache] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for cache in list(_LIVE):
        with contextlib.suppress(Exception):
            cache._flush_stats(force=True)


def _load_stats(path: Path) -> dict[str, float]:
    """The saved counters; a missing or corrupt file counts as zero (and is overwritten)."""
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if k in _COUNTERS and isinstance(v, int | float)}


def _subdirs(path: Path) -> list[Path]:
    try:
        return [path / n for n in os.listdir(path) if len(n) == 2 and not n.startswith(".")]
    except OSError:
        return []


def _read_all(fd: int, size: int) -> bytes:
    chunks, remaining = [], size + 1  # one byte more: a file that grew is caught too
    while remaining > 0:
        chunk = os.read(fd, remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _checksum(meta: bytes, payload: bytes) -> bytes:
    h = hashlib.sha256(meta)
    h.update(payload)
    return h.digest()


def _encode(key: str, kind: str, made: Lookup) -> bytes:
    meta = json.dumps(dict(made.meta), sort_keys=True).encode()
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        KINDS[kind],
        len(meta),
        len(made.payload),
        made.compile_seconds,
        bytes.fromhex(key),
        _checksum(meta, made.payload),
    )
    return header + meta + made.payload


def _parse_header(data: bytes) -> tuple[Any, ...] | None:
    if len(data) < HEADER_SIZE:
        return None
    fields = _HEADER.unpack_from(data)
    magic, version, _kind, meta_len, payload_len = fields[:5]
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    if len(data) != HEADER_SIZE + meta_len + payload_len:
        return None
    return fields


def _decode(data: bytes, key: str, kind: str) -> Lookup | None:
    """The entry in `data`, or None when anything about it is off."""
    fields = _parse_header(data)
    if fields is None:
        return None
    _magic, _version, kind_code, meta_len, _plen, seconds, stored_key, checksum = fields
    if kind_code != KINDS[kind] or stored_key.hex() != key:
        return None
    meta = data[HEADER_SIZE : HEADER_SIZE + meta_len]
    payload = data[HEADER_SIZE + meta_len :]
    if _checksum(meta, payload) != checksum:
        return None
    try:
        meta_obj = json.loads(meta)
    except ValueError:
        return None
    return Lookup(payload, meta_obj, True, seconds)


def _describe(path: Path) -> tuple[str, dict[str, Any]] | None:
    """(kind, meta) of a valid entry file, for listing; None when corrupt."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError:
        return None
    try:
        data = _read_all(fd, os.fstat(fd).st_size)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = _parse_header(data)
    if fields is None:
        return None
    kind = next((name for name, code in KINDS.items() if code == fields[2]), None)
    if kind is None:
        return None
    found = _decode(data, path.name, kind)
    return (kind, dict(found.meta)) if found is not None else None
