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


# -- counters, size tracker, clear and prune: the gaps a mutation run of store.py found.
# The store's clock is a fake where the flush period matters.
class FakeClock:
    """Stands in for the `time` module inside store.py: `now` is what every clock says."""

    def __init__(self, now: float = 1_000_000_000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(kernel_cache.store, "time", fake)
    return fake


def _saved(cache: KernelCache) -> dict[str, Any]:
    """stats.json as another process would read it."""
    path = cache.directory / "stats.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- the flush period -----------------------------------------------------------------
def test_hits_are_batched_within_the_flush_period(tmp_path: Path, clock: FakeClock) -> None:
    cache = KernelCache(tmp_path / "cache")
    lookup(cache, FakeCompiler())  # a compile flushes at once
    assert lookup(cache, FakeCompiler()).hit
    assert _saved(cache).get("hits", 0) == 0  # still pending...
    assert cache.stats()["hits"] == 1  # ...but counted
    assert _saved(cache)["hits"] == 1  # stats() flushes


def test_a_hit_a_full_period_after_the_last_flush_is_saved(
    tmp_path: Path, clock: FakeClock
) -> None:
    cache = KernelCache(tmp_path / "cache")
    clock.now += 5.0
    lookup(cache, FakeCompiler())  # flushes, and restarts the period
    clock.now += 0.5
    assert lookup(cache, FakeCompiler()).hit
    assert _saved(cache).get("hits", 0) == 0  # half a period since the compile's flush
    clock.now += 0.5  # exactly one period
    assert lookup(cache, FakeCompiler()).hit
    assert _saved(cache)["hits"] == 2


def test_exit_flushes_pending_hits(tmp_path: Path, clock: FakeClock) -> None:
    cache = KernelCache(tmp_path / "cache")
    lookup(cache, FakeCompiler())
    assert lookup(cache, FakeCompiler()).hit
    assert _saved(cache).get("hits", 0) == 0
    kernel_cache._flush_all()  # what atexit runs, within the period
    assert _saved(cache)["hits"] == 1


def test_compile_seconds_is_what_the_compile_took(tmp_path: Path, clock: FakeClock) -> None:
    cache = KernelCache(tmp_path / "cache")

    def compile() -> tuple[bytes, dict[str, str]]:
        clock.now += 2.5
        return b"payload", {}

    made = cache.get_or_compile(key_of(0), "ptx", compile)
    assert made.compile_seconds == 2.5
    assert cache.stats()["compile_seconds"] == 2.5
    assert cache.get_or_compile(key_of(0), "ptx", compile).compile_seconds == 2.5


def test_counts_of_a_removed_directory_are_dropped(tmp_path: Path, clock: FakeClock) -> None:
    """Nothing can save them and nothing should retry: the cache is gone."""
    cache = KernelCache(tmp_path / "cache")
    lookup(cache, FakeCompiler())
    assert lookup(cache, FakeCompiler()).hit  # pending
    shutil.rmtree(cache.directory)
    assert cache.stats()["hits"] == 0
    assert not cache.directory.exists()


# -- reading creates nothing ----------------------------------------------------------
def test_reading_a_cache_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache")
    assert cache.stats() == dict.fromkeys(kernel_cache.stats.COUNTERS, 0)
    assert cache.usage() == (0, 0)
    assert cache.entries() == []
    assert cache.prune() == (0, 0)
    assert cache.clear() == 0
    assert not cache.directory.exists()


def test_stats_of_an_empty_cache_write_nothing(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir(mode=0o700)
    cache = KernelCache(tmp_path / "cache")
    assert cache.usable()
    assert cache.stats()["hits"] == 0
    assert list(cache.directory.iterdir()) == []


def test_prune_of_a_cache_without_entries_records_zero_bytes(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache")
    assert cache.usable()  # creates the directory
    assert cache.prune() == (0, 0)
    assert _saved(cache) == {"bytes": 0}
    assert not (cache.directory / "entries").exists()


# -- the size tracker ---------------------------------------------------------------------
def test_the_tracker_follows_writes_and_replacements(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache", max_bytes=1 << 20)
    compiler = FakeCompiler()
    lookup(cache, compiler, 0)
    cache.prune()  # a scan: the tracker is known from here on
    lookup(cache, compiler, 1)
    assert _saved(cache)["bytes"] == cache.usage()[1]
    path = cache.entry_path(key_of(1))
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # damaged: the rewrite replaces it
    assert not lookup(cache, compiler, 1).hit
    assert _saved(cache)["bytes"] == cache.usage()[1]


def test_a_write_landing_exactly_on_the_budget_does_not_scan(tmp_path: Path) -> None:
    probe = KernelCache(tmp_path / "probe")
    lookup(probe, FakeCompiler(), 0)
    entry_size = probe.usage()[1]
    cache = KernelCache(tmp_path / "cache", max_bytes=2 * entry_size)
    lookup(cache, FakeCompiler(), 0)  # the tracker is unknown: this write scans
    stale = cache.entry_path(key_of(0)).parent / f".tmp-999-{'d' * 16}"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    lookup(cache, FakeCompiler(), 1)  # now exactly at the budget: fits, no scan
    assert stale.exists()
    assert cache.usage() == (2, 2 * entry_size + 1)


def test_prune_counts_fresh_temp_files_once(cache: KernelCache) -> None:
    lookup(cache, FakeCompiler())
    fresh = cache.entry_path(key_of(0)).parent / f".tmp-998-{'e' * 16}"
    fresh.write_bytes(b"x" * 100)
    assert cache.prune(max_bytes=1 << 20) == (0, 0)
    assert _saved(cache)["bytes"] == cache.usage()[1]


def test_a_temp_file_exactly_an_hour_old_is_not_stale(cache: KernelCache, clock: FakeClock) -> None:
    lookup(cache, FakeCompiler())
    temp = cache.entry_path(key_of(0)).parent / f".tmp-997-{'f' * 16}"
    temp.write_bytes(b"x")
    os.utime(temp, (clock.now - 3600, clock.now - 3600))
    cache.prune(max_bytes=1)
    assert temp.exists()


# -- prune ----------------------------------------------------------------------------------
def _three_entries(tmp_path: Path) -> tuple[KernelCache, int]:
    cache = KernelCache(tmp_path / "cache", max_bytes=0, warn=OnceWarner())
    compiler = FakeCompiler()
    base = time.time() - 100
    for n in range(3):
        lookup(cache, compiler, n)
        os.utime(cache.entry_path(key_of(n)), (base + n, base + n))
    sizes = {e.size for e in cache.entries()}
    assert len(sizes) == 1
    return cache, sizes.pop()


def test_prune_reports_the_entries_and_bytes_it_freed(tmp_path: Path) -> None:
    cache, size = _three_entries(tmp_path)
    assert cache.prune(max_bytes=size) == (2, 2 * size)
    assert [e.key for e in cache.entries()] == [key_of(2)]


def test_prune_stops_at_an_entry_it_cannot_remove(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, size = _three_entries(tmp_path)
    real = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if path == key_of(0):
            raise OSError(errno.EIO, "I/O error")
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)  # the store calls os.unlink
    assert cache.prune(max_bytes=size) == (0, 0)
    monkeypatch.undo()
    assert len(cache.entries()) == 3


# -- entries() ----------------------------------------------------------------------------
def test_entries_lists_neither_temp_files_nor_foreign_contents(cache: KernelCache) -> None:
    lookup(cache, FakeCompiler(), 0)
    source, copy = cache.entry_path(key_of(0)), cache.entry_path(key_of(1))
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, copy)  # a whole entry, of another key
    (source.parent / f".tmp-996-{'a' * 16}").write_bytes(b"x")
    found = {e.key: e for e in cache.entries()}
    assert set(found) == {key_of(0), key_of(1)}
    assert (found[key_of(0)].kind, found[key_of(0)].meta["arch"]) == ("ptx", "sm_90")
    assert (found[key_of(1)].kind, dict(found[key_of(1)].meta)) == (None, {})


def test_entries_lists_an_unreadable_entry_as_corrupt(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    lookup(cache, FakeCompiler(), 0)

    def unreadable(parent: int, name: str, touch: bool = False) -> bytes:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(kernel_cache.dirs, "read_file", unreadable)
    [entry] = cache.entries()
    assert (entry.key, entry.kind, dict(entry.meta)) == (key_of(0), None, {})


# -- clear ------------------------------------------------------------------------------------
def test_clear_drops_pending_counters(tmp_path: Path, clock: FakeClock) -> None:
    cache = KernelCache(tmp_path / "cache")
    lookup(cache, FakeCompiler())
    assert lookup(cache, FakeCompiler()).hit  # pending
    assert cache.clear() == 1
    assert cache.stats()["hits"] == 0


def test_clear_creates_no_locks_directory(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "cache")
    assert cache.usable()
    assert cache.clear() == 0
    assert list(cache.directory.iterdir()) == []


def test_clear_and_lookups_leave_no_descriptor_open(cache: KernelCache) -> None:
    compiler = FakeCompiler()
    lookup(cache, compiler)
    before = _open_fds()
    for _ in range(5):
        assert lookup(cache, compiler).hit
    cache.clear()
    assert _open_fds() == before


# -- corrupt counts -----------------------------------------------------------------------
def test_a_damaged_entry_healed_while_waiting_counts_as_corrupt_once(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = KernelCache(cache.directory, warn=OnceWarner())
    lookup(other, FakeCompiler(), 0)
    path = cache.entry_path(key_of(0))
    path.write_bytes(path.read_bytes()[:-1])
    real = cache._key_lock

    @contextlib.contextmanager
    def key_lock(key: str) -> Iterator[None]:
        other.clear()
        lookup(other, FakeCompiler(), 0)  # the other process heals it meanwhile
        with real(key):
            yield

    monkeypatch.setattr(cache, "_key_lock", key_lock)
    found = lookup(cache, FakeCompiler(), 0)
    assert (found.hit, found.waited) == (True, True)
    assert cache.stats()["corrupt"] == 1


# -- fork ---------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_count_its_parents_pending_hits(
    tmp_path: Path, clock: FakeClock
) -> None:
    cache = KernelCache(tmp_path / "cache")
    lookup(cache, FakeCompiler())
    assert lookup(cache, FakeCompiler()).hit  # pending in the parent
    pid = os.fork()
    if pid == 0:  # the child: flush whatever it has, then leave at once
        code = 1
        try:
            cache.stats()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.stats()["hits"] == 1  # the parent's one hit, saved once


def test_a_disabled_cache_ignores_an_existing_cache(tmp_path: Path) -> None:
    """CAPSAFE_KERNEL_CACHE=0 over a populated directory: no hit, no write, no count."""
    lookup(KernelCache(tmp_path / "cache"), FakeCompiler(), 0)
    before = sorted(p.name for p in (tmp_path / "cache").rglob("*"))
    disabled = KernelCache(tmp_path / "cache", enabled=False)
    compiler = FakeCompiler()
    assert not lookup(disabled, compiler, 0).hit
    assert not lookup(disabled, compiler, 1).hit
    assert compiler.calls == 2
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*")) == before
    assert KernelCache(tmp_path / "cache").stats()["compiles"] == 1


def test_prune_never_recreates_a_shard_removed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process removed an entry and its directories after the scan."""
    cache, size = _three_entries(tmp_path)
    shard = cache.entry_path(key_of(0)).parent
    real = kernel_cache.dirs.walk

    def walk(entries: int) -> Iterator[Any]:
        yield from real(entries)
        shutil.rmtree(shard)

    monkeypatch.setattr(kernel_cache.dirs, "walk", walk)
    assert cache.prune(max_bytes=size) == (1, size)
    assert not shard.exists()
    assert [e.key for e in cache.entries()] == [key_of(2)]
