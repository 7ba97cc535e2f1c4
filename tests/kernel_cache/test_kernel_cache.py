"""The kernel disk cache alone: a fake compiler stands in for NVRTC where speed is all it adds."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from capsafe import kernel_cache
from capsafe.errors import UsageError
from capsafe.kernel_cache import (
    DEFAULT_MAX_BYTES,
    HEADER_SIZE,
    KernelCache,
    Lookup,
    OnceWarner,
    cache_key,
    default_directory,
    settings_from_env,
)


class FakeCompiler:
    """Counts compiles; the payload depends only on the key, like a real compiler's."""

    def __init__(self, size: int = 200, delay: float = 0.0) -> None:
        self.calls = 0
        self.size, self.delay = size, delay
        self._lock = threading.Lock()

    def for_key(self, key: str) -> Callable[[], tuple[bytes, dict[str, str]]]:
        def compile() -> tuple[bytes, dict[str, str]]:
            with self._lock:
                self.calls += 1
            if self.delay:
                time.sleep(self.delay)
            return payload_for(key, self.size), {"name": f"{key[:6]}.cu", "arch": "sm_90"}

        return compile


def payload_for(key: str, size: int = 200) -> bytes:
    return (key.encode() * (size // 64 + 1))[:size]


def key_of(n: int) -> str:
    return cache_key([f"kernel-{n}"])


@pytest.fixture
def warner() -> OnceWarner:
    return OnceWarner()


@pytest.fixture
def cache(tmp_path: Path, warner: OnceWarner) -> KernelCache:
    return KernelCache(tmp_path / "cache", warn=warner)


def lookup(cache: KernelCache, compiler: FakeCompiler, n: int = 0, kind: str = "ptx") -> Lookup:
    key = key_of(n)
    return cache.get_or_compile(key, kind, compiler.for_key(key))


def test_miss_publishes_and_the_next_lookup_hits(cache: KernelCache) -> None:
    compiler = FakeCompiler()
    first, second = lookup(cache, compiler), lookup(cache, compiler)
    assert (first.hit, second.hit) == (False, True)
    assert first.payload == second.payload == payload_for(key_of(0))
    assert second.meta["name"] == first.meta["name"]
    assert compiler.calls == 1
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["compiles"]) == (1, 1, 1)
    assert stats["saved_seconds"] == pytest.approx(first.compile_seconds)


def test_entries_live_in_two_level_private_directories(cache: KernelCache) -> None:
    lookup(cache, FakeCompiler())
    key = key_of(0)
    path = cache.entry_path(key)
    assert path.relative_to(cache.directory).parts == ("entries", key[:2], key[2:4], key)
    assert path.read_bytes()[:4] == b"CSKC"
    assert os.stat(cache.directory).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_kinds_do_not_share_entries(cache: KernelCache) -> None:
    compiler = FakeCompiler()
    lookup(cache, compiler, kind="ptx")
    assert not lookup(cache, compiler, kind="cubin").hit  # same key, other kind: a miss


def test_disabled_cache_compiles_every_time(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache", enabled=False)
    compiler = FakeCompiler()
    assert not any(lookup(cache, compiler).hit for _ in range(3))
    assert compiler.calls == 3
    assert not (tmp_path / "cache").exists()


def test_compile_errors_propagate_and_publish_nothing(cache: KernelCache) -> None:
    def broken() -> NoReturn:
        raise RuntimeError("bad source")

    with pytest.raises(RuntimeError, match="bad source"):
        cache.get_or_compile(key_of(0), "ptx", broken)
    assert cache.usage() == (0, 0)


def _truncate(data: bytes) -> bytes:
    return data[: len(data) - 7]


def _flip(data: bytes) -> bytes:
    i = len(data) - 3
    return data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]


def _flip_header(data: bytes) -> bytes:
    return data[:6] + bytes([data[6] ^ 0x01]) + data[7:]  # the kind byte


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        lambda d: b"",
        _flip,
        _flip_header,
        lambda d: os.urandom(len(d)),
        lambda d: d[: HEADER_SIZE - 1],
        lambda d: d + b"trailing",
    ],
    ids=[
        "truncated",
        "zero-length",
        "bit-flipped",
        "header-flipped",
        "garbage",
        "short-header",
        "grown",
    ],
)
def test_damaged_entries_recompile_and_heal(
    cache: KernelCache, damage: Callable[[bytes], bytes]
) -> None:
    compiler = FakeCompiler()
    lookup(cache, compiler)
    path = cache.entry_path(key_of(0))
    path.write_bytes(damage(path.read_bytes()))
    healed = lookup(cache, compiler)
    assert not healed.hit and healed.payload == payload_for(key_of(0))
    assert lookup(cache, compiler).hit  # replaced by a valid entry
    assert compiler.calls == 2
    assert cache.stats()["corrupt"] == 1


def test_an_entry_copied_to_another_key_is_a_miss(cache: KernelCache) -> None:
    compiler = FakeCompiler()
    lookup(cache, compiler, 0)
    other = cache.entry_path(key_of(1))
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(cache.entry_path(key_of(0)).read_bytes())
    assert lookup(cache, compiler, 1).payload == payload_for(key_of(1))


def test_symlink_at_entry_is_a_miss_and_never_written_through(
    cache: KernelCache, tmp_path: Path, warner: OnceWarner
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = cache.entry_path(key_of(0))
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    compiler = FakeCompiler()
    assert not lookup(cache, compiler).hit
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink()  # the link itself was replaced by the entry
    assert lookup(cache, compiler).hit
    assert warner.warned


def test_symlink_at_temp_path_is_never_written_through(
    cache: KernelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(kernel_cache.stats, "temp_name", lambda: ".tmp-planted")
    path = cache.entry_path(key_of(0))
    path.parent.mkdir(parents=True)
    (path.parent / ".tmp-planted").symlink_to(victim)
    compiler = FakeCompiler()
    made = lookup(cache, compiler)
    assert made.payload == payload_for(key_of(0))
    assert victim.read_bytes() == b"precious"
    assert (path.parent / ".tmp-planted").is_symlink()  # not ours: left alone
    assert not path.exists()


def _raise(code: int) -> Callable[..., NoReturn]:
    def fail(*args: object, **kwargs: object) -> NoReturn:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize(
    "code", [errno.EROFS, errno.ENOSPC, errno.ESTALE, errno.EACCES, errno.ENOENT]
)
def test_publish_failures_fall_through_to_compiling(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch, warner: OnceWarner, code: int
) -> None:
    compiler = FakeCompiler()
    monkeypatch.setattr(os, "replace", _raise(code))
    assert lookup(cache, compiler).payload == payload_for(key_of(0))
    assert lookup(cache, compiler).payload == payload_for(key_of(0))
    monkeypatch.undo()
    assert compiler.calls == 2
    assert warner.warned
    assert cache.usage() == (0, 0)  # no entry, no temp file left behind


def test_disk_full_while_writing_falls_through(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "write", _raise(errno.ENOSPC))
    made = lookup(cache, FakeCompiler())
    monkeypatch.undo()
    assert made.payload == payload_for(key_of(0))
    assert cache.usage() == (0, 0)


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EACCES, errno.EIO])
def test_read_failures_fall_through_to_compiling(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    compiler = FakeCompiler()
    lookup(cache, compiler)
    real_open = os.open

    def failing_open(path: str, flags: int, *args: Any, **kwargs: Any) -> int:
        if kwargs.get("dir_fd") is not None and not flags & (os.O_CREAT | os.O_DIRECTORY):
            raise OSError(code, os.strerror(code))  # reading an entry file
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    assert lookup(cache, compiler).payload == payload_for(key_of(0))
    assert compiler.calls == 2


def test_read_only_cache_directory_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warner: OnceWarner
) -> None:
    cache = KernelCache(tmp_path / "cache", warn=warner)
    compiler = FakeCompiler()
    lookup(cache, compiler, 0)
    for root, dirs, _files in os.walk(cache.directory):
        for d in dirs:
            os.chmod(Path(root) / d, 0o500)
    os.chmod(cache.directory, 0o500)
    # chmod does not stop root (tests may run as root); EROFS on every create does.
    real_open = os.open

    def read_only_open(path: str, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    monkeypatch.setattr(os, "makedirs", _raise(errno.EROFS))
    try:
        assert lookup(cache, compiler, 0).hit  # reads still work
        assert lookup(cache, compiler, 1).payload == payload_for(key_of(1))
        assert not lookup(cache, compiler, 1).hit
    finally:
        monkeypatch.undo()
        for root, dirs, _files in os.walk(cache.directory):
            os.chmod(root, 0o700)
            for d in dirs:
                os.chmod(Path(root) / d, 0o700)


def test_problems_warn_once_per_process(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "replace", _raise(errno.ENOSPC))
    compiler = FakeCompiler()
    with caplog.at_level(logging.WARNING, logger="capsafe.kernel_cache"):
        for n in range(3):
            lookup(cache, compiler, n)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "compiling without the cache" in warnings[0].getMessage()


def test_group_writable_directory_is_refused(
    tmp_path: Path, warner: OnceWarner, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, 0o770)
    cache = KernelCache(directory, warn=warner)
    compiler = FakeCompiler()
    with caplog.at_level(logging.WARNING, logger="capsafe.kernel_cache"):
        assert not lookup(cache, compiler).hit
        assert not lookup(cache, compiler).hit
    assert compiler.calls == 2
    assert list(directory.iterdir()) == []
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1 and "writable by group or others" in messages[0]


def test_directory_of_another_user_is_refused(
    tmp_path: Path, warner: OnceWarner, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(directory, 4242, -1)
    else:
        owner = os.stat(directory).st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    cache = KernelCache(directory, warn=warner)
    assert not cache.usable()
    assert not lookup(cache, FakeCompiler()).hit
    assert warner.warned


def _entries_in_lru_order(cache: KernelCache) -> list[str]:
    return [e.key for e in cache.entries()]


def test_lru_evicts_the_least_recently_used_first(tmp_path: Path) -> None:
    probe = KernelCache(tmp_path / "probe")
    lookup(probe, FakeCompiler(), 0)
    entry_size = probe.usage()[1]
    cache = KernelCache(tmp_path / "cache", max_bytes=3 * entry_size)
    compiler = FakeCompiler()
    for n in range(3):
        lookup(cache, compiler, n)
    base = time.time() - 100
    for n in range(3):
        os.utime(cache.entry_path(key_of(n)), (base + n, base + n))
    assert lookup(cache, compiler, 0).hit  # bumps entry 0: now entry 1 is the oldest
    lookup(cache, compiler, 3)
    assert set(_entries_in_lru_order(cache)) == {key_of(0), key_of(2), key_of(3)}
    lookup(cache, compiler, 4)
    assert set(_entries_in_lru_order(cache)) == {key_of(0), key_of(3), key_of(4)}
    assert cache.usage()[1] <= 3 * entry_size


def test_under_budget_loses_nothing(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache", max_bytes=1 << 20)
    compiler = FakeCompiler()
    for n in range(10):
        lookup(cache, compiler, n)
    assert cache.usage()[0] == 10
    assert all(lookup(cache, compiler, n).hit for n in range(10))


def test_budget_zero_evicts_nothing(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache", max_bytes=0)
    compiler = FakeCompiler(size=4096)
    for n in range(12):
        lookup(cache, compiler, n)
    assert cache.prune() == (0, 0)
    assert cache.usage()[0] == 12


def test_an_entry_larger_than_the_budget_is_kept_until_the_next_write(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache", max_bytes=100)
    compiler = FakeCompiler(size=1000)
    lookup(cache, compiler, 0)
    assert lookup(cache, compiler, 0).hit
    lookup(cache, compiler, 1)
    assert _entries_in_lru_order(cache) == [key_of(1)]


def test_prune_removes_stale_temp_files_of_crashed_writers(cache: KernelCache) -> None:
    lookup(cache, FakeCompiler())
    stale = cache.entry_path(key_of(0)).parent / f".tmp-999-{'d' * 16}"
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = stale.with_name(f".tmp-998-{'e' * 16}")
    fresh.write_bytes(b"x")
    cache.prune(max_bytes=1)
    assert not stale.exists() and fresh.exists()


def test_clear_removes_entries_and_counters(cache: KernelCache) -> None:
    compiler = FakeCompiler()
    for n in range(3):
        lookup(cache, compiler, n)
    assert (cache.directory / "locks" / "stats.lock").is_file()
    assert cache.clear() == 3
    assert cache.usage() == (0, 0)
    assert list((cache.directory / "locks").iterdir()) == []  # stats.lock and key locks
    assert cache.stats()["compiles"] == 0


def test_a_compile_is_on_disk_at_once_and_hits_within_the_flush_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other processes read stats.json: a compile flushes at once; hits are batched
    (here the period is 0, so each hit flushes)."""
    cache = KernelCache(tmp_path / "cache")
    lookup(cache, FakeCompiler(), 0)
    on_disk = json.loads((cache.directory / "stats.json").read_text())
    assert on_disk["compiles"] == 1
    key = key_of(1)  # compiled, not published: nothing else flushes it
    cache.get_or_compile(key, "ptx", FakeCompiler().for_key(key), publish_if=lambda: False)
    assert json.loads((cache.directory / "stats.json").read_text())["compiles"] == 2
    monkeypatch.setattr(kernel_cache.store, "_STATS_FLUSH_SECONDS", 0.0)
    assert lookup(cache, FakeCompiler(), 0).hit
    assert json.loads((cache.directory / "stats.json").read_text())["hits"] == 1


def test_counts_that_could_not_be_saved_are_kept_for_later(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    @contextlib.contextmanager
    def busy(directory: object) -> Iterator[int]:
        raise kernel_cache.lock.LockUnavailable("held")
        yield 0

    monkeypatch.setattr(kernel_cache.stats, "locked", busy)
    lookup(cache, FakeCompiler(), 0)
    lookup(cache, FakeCompiler(), 0)
    assert {k: cache.stats()[k] for k in ("hits", "misses", "compiles")} == {
        "hits": 1,
        "misses": 1,
        "compiles": 1,
    }
    monkeypatch.undo()
    cache.stats()  # saved now
    saved = json.loads((cache.directory / "stats.json").read_text())
    assert (saved["hits"], saved["misses"], saved["compiles"]) == (1, 1, 1)


def test_stats_add_up_across_instances_and_survive_a_corrupt_file(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    first, second = KernelCache(directory), KernelCache(directory)
    compiler = FakeCompiler()
    lookup(first, compiler)
    lookup(second, compiler)
    second.stats()  # reading flushes this instance's batched hits
    assert first.stats()["hits"] == 1 and first.stats()["compiles"] == 1
    (directory / "stats.json").write_bytes(b"\x00{not json")
    assert first.stats()["compiles"] == 0  # corrupt counters restart from zero
    lookup(second, compiler)
    assert second.stats()["hits"] == 1
    (directory / "stats.json").write_text("[1, 2]")
    assert first.stats()["hits"] == 0


def test_counters_never_recreate_a_removed_directory(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache")
    compiler = FakeCompiler()
    lookup(cache, compiler)
    lookup(cache, compiler)  # a batched hit, still pending
    shutil.rmtree(tmp_path / "cache")
    kernel_cache._flush_all()  # what atexit runs
    assert not (tmp_path / "cache").exists()


def test_threads_missing_the_same_key_compile_once(cache: KernelCache) -> None:
    compiler = FakeCompiler(delay=0.05)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(lookup(cache, compiler))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert compiler.calls == 1
    assert len(results) == 8 and sum(r.hit for r in results) == 7
    stats = cache.stats()  # how many waited (vs. arrived after the publish) depends on timing
    assert (stats["compiles"], stats["hits"], stats["misses"] - stats["waits"]) == (1, 7, 1)


def test_a_negative_budget_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="max_bytes must be >= 0"):
        KernelCache(tmp_path / "cache", max_bytes=-1)
    assert KernelCache(tmp_path / "cache", max_bytes=0).max_bytes == 0


def test_an_entry_published_while_waiting_for_the_key_lock_is_a_waited_hit(
    cache: KernelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a process sees when another one compiled the key while it waited."""
    other = KernelCache(cache.directory)
    real = cache._key_lock

    @contextlib.contextmanager
    def key_lock(key: str) -> Iterator[None]:
        lookup(other, FakeCompiler(), 0)  # the other process publishes it meanwhile
        with real(key):
            yield

    monkeypatch.setattr(cache, "_key_lock", key_lock)
    compiler = FakeCompiler()
    found = lookup(cache, compiler, 0)
    assert (found.hit, found.waited, compiler.calls) == (True, True, 0)
    stats = cache.stats()
    assert (stats["hits"], stats["waits"], stats["misses"]) == (1, 1, 2)


def test_a_cache_directory_that_is_not_a_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a swap between creating and checking it gets here (makedirs refuses a
    file): the check must still refuse it."""
    path = tmp_path / "cache"
    path.write_text("a file")
    warnings: list[str] = []
    monkeypatch.setattr(os, "makedirs", lambda *args, **kwargs: None)
    cache = KernelCache(path, warn=warnings.append)
    assert not cache.usable()
    assert warnings == [f"{path} is not a directory"]


def test_unknown_kind_is_a_usage_error(cache: KernelCache) -> None:
    with pytest.raises(UsageError, match="kind"):
        cache.get_or_compile(key_of(0), "fatbin", FakeCompiler().for_key(key_of(0)))


def test_settings_come_from_the_environment(tmp_path: Path) -> None:
    defaults = settings_from_env({"XDG_CACHE_HOME": str(tmp_path)})
    assert defaults.directory == tmp_path / "capsafe" / "nvrtc"
    assert (defaults.max_bytes, defaults.enabled) == (DEFAULT_MAX_BYTES, True)
    custom = settings_from_env(
        {
            "CAPSAFE_KERNEL_CACHE_DIR": str(tmp_path / "k"),
            "CAPSAFE_KERNEL_CACHE_MAX_BYTES": "0",
            "CAPSAFE_KERNEL_CACHE": "0",
        }
    )
    assert (custom.directory, custom.max_bytes, custom.enabled) == (tmp_path / "k", 0, False)
    assert default_directory({"XDG_CACHE_HOME": "relative"}) != Path("relative/capsafe/nvrtc")
    for bad in (
        {"CAPSAFE_KERNEL_CACHE_MAX_BYTES": "lots"},
        {"CAPSAFE_KERNEL_CACHE_MAX_BYTES": "-1"},
        {"CAPSAFE_KERNEL_CACHE": "maybe"},
    ):
        with pytest.raises(UsageError):
            settings_from_env(bad)
