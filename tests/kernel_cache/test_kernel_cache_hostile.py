"""Hostile inputs and failures on the cache path (issue 12, problems 10, 11 and 12).

Each test would fail on the single-module cache it replaced: a FIFO blocked, a
symlinked shard was written through and pruned through, every write rescanned the
directory, header flips were served, close() errors escaped, bad keys compiled
first, a fork could inherit a held lock, a stopped holder stalled waiters for the
whole lock timeout, and PCH options were cached.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capsafe import kernel_cache, nvrtc
from capsafe.backend_cuda import NvrtcOutput
from capsafe.errors import UsageError
from capsafe.kernel_cache import HEADER_SIZE, KernelCache, Lookup, OnceWarner, cache_key

PAYLOAD_SIZE = 300


def key_of(n: int) -> str:
    return cache_key(["hostile", str(n)])


def payload_for(key: str) -> bytes:
    return (key.encode() * (PAYLOAD_SIZE // 64 + 1))[:PAYLOAD_SIZE]


class Compiler:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, key: str) -> Callable[[], tuple[bytes, dict[str, str]]]:
        def compile() -> tuple[bytes, dict[str, str]]:
            self.calls += 1
            return payload_for(key.lower()), {"name": "k.cu"}

        return compile


@pytest.fixture
def warner() -> OnceWarner:
    return OnceWarner()


@pytest.fixture
def cache(tmp_path: Path, warner: OnceWarner) -> KernelCache:
    return KernelCache(tmp_path / "cache", warn=warner)


def lookup(cache: KernelCache, compiler: Compiler, n: int = 0) -> Lookup:
    return cache.get_or_compile(key_of(n), "ptx", compiler(key_of(n)))


# -- 10: FIFOs and symlinks ---------------------------------------------------------------
@pytest.mark.timeout(20)
def test_a_fifo_at_an_entry_path_is_a_miss_not_a_hang(cache: KernelCache) -> None:
    path = cache.entry_path(key_of(0))
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    compiler = Compiler()
    made = lookup(cache, compiler)  # the old code blocked in open() forever
    assert made.payload == payload_for(key_of(0)) and not made.hit
    assert lookup(cache, compiler).hit  # the FIFO was replaced by the entry


def test_a_symlinked_shard_is_never_written_or_pruned_through(
    cache: KernelCache, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    (victim / "cd").mkdir(parents=True)
    precious = victim / "cd" / "thesis.tex"
    precious.write_text("years of work")
    key = "ab" + "cd" + key_of(0)[4:]
    cache.entries_dir.mkdir(parents=True)
    (cache.entries_dir / "ab").symlink_to(victim)
    made = cache.get_or_compile(key, "ptx", Compiler()(key))
    assert made.payload == payload_for(key)
    assert sorted(p.name for p in victim.rglob("*")) == ["cd", "thesis.tex"]  # nothing written
    cache.prune(max_bytes=1)
    assert precious.read_text() == "years of work"
    assert (cache.entries_dir / "ab").is_dir() and not (cache.entries_dir / "ab").is_symlink()


def test_prune_removes_only_digest_named_files(cache: KernelCache) -> None:
    lookup(cache, Compiler())
    shard = cache.entry_path(key_of(0)).parent
    notes = shard / "notes.txt"
    notes.write_text("mine")
    misplaced = shard / key_of(1)  # a digest name in the wrong shard
    misplaced.write_bytes(b"x" * 100)
    odd = cache.entries_dir / "zz" / "yy"
    odd.mkdir(parents=True)
    (odd / key_of(2)).write_bytes(b"x" * 100)
    removed, _freed = cache.prune(max_bytes=1)
    assert removed == 1  # the entry; the old code deleted every file two levels down
    assert notes.exists() and misplaced.exists() and (odd / key_of(2)).exists()
    assert not cache.entry_path(key_of(0)).exists()


# -- 11: writes do not scan -------------------------------------------------------------
def test_a_write_under_budget_lists_no_directory(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = Compiler()
    for n in range(20):
        lookup(cache, compiler, n)
    listed: list[tuple[Any, ...]] = []
    real_listdir, real_scandir = os.listdir, os.scandir

    def listdir(*args: Any, **kwargs: Any) -> list[str]:
        listed.append(args)
        return real_listdir(*args, **kwargs)

    def scandir(*args: Any, **kwargs: Any) -> Iterator[os.DirEntry[str]]:
        listed.append(args)
        return real_scandir(*args, **kwargs)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "scandir", scandir)
    for n in range(20, 40):
        assert not lookup(cache, compiler, n).hit
    assert listed == []  # the old code rescanned every directory on every write


def test_the_size_tracker_evicts_when_the_budget_is_exceeded(tmp_path: Path) -> None:
    probe = KernelCache(tmp_path / "probe")
    lookup(probe, Compiler())
    entry_size = probe.usage()[1]
    cache = KernelCache(tmp_path / "cache", max_bytes=5 * entry_size)
    compiler = Compiler()
    for n in range(12):
        lookup(cache, compiler, n)
        assert cache.usage()[1] <= 5 * entry_size
    stats = json.loads((cache.directory / "stats.json").read_text())
    assert stats["bytes"] == cache.usage()[1]


# -- 12: smaller ---------------------------------------------------------------------------
def test_every_header_bit_flip_is_a_miss(cache: KernelCache) -> None:
    compiler = Compiler()
    lookup(cache, compiler)
    path = cache.entry_path(key_of(0))
    good = path.read_bytes()

    def flipped(bit: int) -> bytes:
        damaged = bytearray(good)
        damaged[bit // 8] ^= 1 << (bit % 8)
        return bytes(damaged)

    # Through the cache, the 72 bits the old checksum skipped: the pad byte and the seconds.
    served = []
    for bit in [*range(7 * 8, 8 * 8), *range(20 * 8, 28 * 8)]:
        path.write_bytes(flipped(bit))
        if lookup(cache, compiler).hit and path.read_bytes() == flipped(bit):
            served.append(bit)
        path.write_bytes(good)
    assert served == []
    from capsafe.kernel_cache import format as entry_format  # every other header bit, directly

    assert entry_format.decode(good) is not None
    assert [b for b in range(HEADER_SIZE * 8) if entry_format.decode(flipped(b))] == []


def test_a_nan_in_the_seconds_field_never_reaches_the_statistics(cache: KernelCache) -> None:
    compiler = Compiler()
    lookup(cache, compiler)
    path = cache.entry_path(key_of(0))
    data = bytearray(path.read_bytes())
    data[20:28] = struct.pack("<d", math.nan)  # the compile-seconds field
    path.write_bytes(bytes(data))
    assert not lookup(cache, compiler).hit
    assert lookup(cache, compiler).hit
    totals = cache.stats()
    assert all(math.isfinite(v) for v in totals.values()), totals
    assert "NaN" not in (cache.directory / "stats.json").read_text()


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_a_failing_close_after_a_read_falls_through(
    cache: KernelCache, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    compiler = Compiler()
    lookup(cache, compiler)
    real_open, real_close = os.open, os.close
    entry_fds: set[int] = set()

    def open_(path: str | os.PathLike[str], flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if str(path).endswith(key_of(0)) and not flags & os.O_CREAT:
            entry_fds.add(fd)
        return fd

    def close(fd: int) -> None:
        real_close(fd)
        if fd in entry_fds:
            entry_fds.discard(fd)
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "close", close)
    made = lookup(cache, compiler)  # the old code let the close() error escape
    monkeypatch.undo()
    assert made.payload == payload_for(key_of(0))


FAULTY = (
    "open",
    "close",
    "read",
    "write",
    "stat",
    "fstat",
    "replace",
    "unlink",
    "mkdir",
    "utime",
    "pread",
    "pwrite",
    "ftruncate",
)


@pytest.mark.parametrize("name", FAULTY)
@pytest.mark.parametrize("warm", [False, True], ids=["miss", "hit"])
def test_an_os_error_from_any_call_falls_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, warm: bool
) -> None:
    """EIO from the k-th call of `name`, for every k a lookup makes: never raised."""
    real = getattr(os, name)

    def run(fail_at: int | None) -> int:
        cache = KernelCache(tmp_path / f"c{fail_at}", warn=OnceWarner())
        compiler = Compiler()
        if warm:
            lookup(cache, compiler)
        count = 0

        def faulty(*args: Any, **kwargs: Any) -> Any:  # whichever os function `name` is
            nonlocal count
            count += 1
            if count == fail_at:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, faulty)
        try:
            made = lookup(cache, compiler)
        finally:
            monkeypatch.setattr(os, name, real)
        assert made.payload == payload_for(key_of(0))
        return count

    calls = run(None)
    for k in range(1, calls + 1):
        run(k)


def test_a_non_hex_key_is_refused_before_compiling(cache: KernelCache) -> None:
    compiler = Compiler()
    for bad in ["not-a-key", "g" * 64, key_of(0)[:63], key_of(0) + "0"]:
        with pytest.raises(UsageError, match="64 hex digits"):
            cache.get_or_compile(bad, "ptx", compiler(bad))
    assert compiler.calls == 0  # the old code compiled, then raised ValueError


def test_an_uppercase_key_is_the_same_entry(cache: KernelCache) -> None:
    compiler = Compiler()
    lookup(cache, compiler)
    again = cache.get_or_compile(key_of(0).upper(), "ptx", compiler(key_of(0)))
    assert again.hit and compiler.calls == 1  # the old code never hit


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_holds_the_cache_lock_does_not_hang_the_child(
    cache: KernelCache,
) -> None:
    compiler = Compiler()
    lookup(cache, compiler)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cache._mutex:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(60)  # a hang watchdog: unasserted, a late holder made it vacuous
    pid = os.fork()
    if pid == 0:  # the child: one lookup, then out, whatever happens
        code = 1
        try:
            signal.alarm(20)
            code = 0 if lookup(cache, compiler).hit else 2
        finally:
            os._exit(code)
    release.set()
    holder.join()
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on a lock its parent's other thread held")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


HOLDER = textwrap.dedent(
    """
    import sys, time
    from capsafe.kernel_cache import KernelCache
    cache = KernelCache(sys.argv[1])
    def compile():
        print("holding", flush=True)
        time.sleep(120)
        return b"late", {}
    cache.get_or_compile(sys.argv[2], "ptx", compile)
    """
)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_lock_holder_is_named_and_not_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory, key = tmp_path / "cache", key_of(0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), key], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        os.kill(holder.pid, signal.SIGSTOP)
        cache = KernelCache(directory)  # the default lock timeout: 600 s
        with caplog.at_level(logging.DEBUG, logger="capsafe.kernel_cache"):
            # The old code waited the whole 600 s: the watchdog (300 s) fails it.
            made = cache.get_or_compile(key, "ptx", Compiler()(key))
        assert made.payload == payload_for(key)
        assert any(f"pid {holder.pid}" in r.getMessage() for r in caplog.records)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)


@pytest.mark.parametrize(
    "option", ["-pch", "--pch", "--create-pch=x.pch", "--use-pch=x.pch", "--pch-dir=/tmp"]
)
def test_pch_options_are_compiled_uncached_with_a_reason(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    option: str,
) -> None:
    monkeypatch.setattr(nvrtc, "UNCACHED_WARNER", OnceWarner("; uncached"), raising=False)
    cache = KernelCache(tmp_path / "cache")
    calls = []

    def compiler(*args: object) -> NvrtcOutput:
        calls.append(args)
        return NvrtcOutput(b"// ptx\n", "")

    spec = nvrtc.KernelSpec("__global__ void k() {}\n", "k.cu", options=(option,))
    with caplog.at_level(logging.WARNING, logger="capsafe.kernel_cache"):
        for _ in range(2):
            art = nvrtc.compile_spec(spec, cache=cache, compiler=compiler, nvrtc_version=(13, 5))
            assert not art.cached
    assert len(calls) == 2 and cache.usage() == (0, 0)  # the old code served the second
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "precompiled headers" in warnings[0], warnings


def test_the_package_keeps_the_module_interface() -> None:
    """`from capsafe import kernel_cache` callers keep working after the split."""
    for name in ("KernelCache", "cache_key", "default_cache", "settings_from_env", "KINDS"):
        assert hasattr(kernel_cache, name), name


# -- issue 22, item 7 ----------------------------------------------------------------------
def test_a_relative_directory_does_not_follow_a_later_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warner: OnceWarner
) -> None:
    """The directory checked is the one used: a chdir after the check must not make the
    cache serve an entry planted in another (here world-writable) directory."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    planted = KernelCache(theirs / "cache")
    key = key_of(0)
    planted.get_or_compile(key, "ptx", lambda: (b"planted payload", {}))
    os.chmod(theirs / "cache", 0o777)
    monkeypatch.chdir(mine)
    cache = KernelCache("cache", warn=warner)
    assert cache.usable()  # checks mine/cache
    monkeypatch.chdir(theirs)
    compiler = Compiler()
    made = cache.get_or_compile(key, "ptx", compiler(key))
    assert made.payload == payload_for(key) and not made.hit  # the old code served the plant
    assert cache.directory == mine / "cache"
    assert cache.entry_path(key).is_file()


def _non_regular(kind: str, path: Path, elsewhere: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        (path / "inside").mkdir(parents=True)
        (path / "inside" / "file").write_text("x")
    else:
        path.symlink_to(elsewhere)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_non_regular_stats_lock_is_replaced_and_the_budget_still_holds(
    tmp_path: Path, kind: str, warner: OnceWarner
) -> None:
    """A FIFO, directory or symlink at locks/stats.lock refused the statistics lock for
    good, so eviction never ran again (70 KiB held under a 16 KiB budget)."""
    budget = 16 * 1024
    cache = KernelCache(tmp_path / "cache", max_bytes=budget, warn=warner)
    payload = b"p" * 4000
    cache.get_or_compile(key_of(0), "ptx", lambda: (payload, {}))
    lock_path = cache.directory / "locks" / "stats.lock"
    lock_path.unlink()
    target = tmp_path / "target"
    target.write_text("not a lock")
    _non_regular(kind, lock_path, target)
    for n in range(1, 19):  # about 72 KiB written
        cache.get_or_compile(key_of(n), "ptx", lambda: (payload, {}))
        assert cache.usage()[1] <= budget
    assert lock_path.is_file() and not lock_path.is_symlink()  # replaced by a lock file
    assert target.read_text() == "not a lock"  # a symlink's target is never touched
    assert json.loads((cache.directory / "stats.json").read_text())["bytes"] <= budget
    assert not warner.warned  # repaired quietly: nothing failed


def test_a_stats_lock_that_cannot_be_replaced_is_reported_and_eviction_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warnings: list[str] = []
    budget = 16 * 1024
    cache = KernelCache(tmp_path / "cache", max_bytes=budget, warn=warnings.append)
    payload = b"p" * 4000
    cache.get_or_compile(key_of(0), "ptx", lambda: (payload, {}))
    lock_path = cache.directory / "locks" / "stats.lock"
    lock_path.unlink()
    os.mkfifo(lock_path)
    monkeypatch.setattr(kernel_cache.lock, "_remove_non_regular", lambda parent, name: None)
    for n in range(1, 19):
        cache.get_or_compile(key_of(n), "ptx", lambda: (payload, {}))
        assert cache.usage()[1] <= budget
    assert any("a FIFO" in w and "pruning unlocked" in w for w in warnings), warnings


def test_a_failed_rename_is_reported_and_not_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warnings: list[str] = []
    cache = KernelCache(tmp_path / "cache", warn=warnings.append)
    lookup(cache, Compiler(), 0)  # the tracker is known from here on
    before = json.loads((cache.directory / "stats.json").read_text())["bytes"]
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if dst == key_of(1):
            raise OSError(errno.EIO, "injected")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    made = lookup(cache, Compiler(), 1)
    assert made.payload == payload_for(key_of(1)) and not made.hit
    assert any("cannot write" in w for w in warnings), warnings
    monkeypatch.undo()
    assert json.loads((cache.directory / "stats.json").read_text())["bytes"] == before
    assert cache.usage() == (1, before)  # no entry, no temp file left


def test_an_unbounded_cache_never_scans_on_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = KernelCache(tmp_path / "cache", max_bytes=0)
    lookup(cache, Compiler(), 0)
    scanned: list[object] = []

    def prune(*a: object, **k: object) -> tuple[int, int]:
        scanned.append(a)
        return (0, 0)

    monkeypatch.setattr(cache, "prune", prune)
    for n in range(1, 5):
        lookup(cache, Compiler(), n)
    assert scanned == []


def test_prune_of_an_empty_cache_and_of_a_locked_one_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warnings: list[str] = []
    cache = KernelCache(tmp_path / "cache", warn=warnings.append)
    assert cache.usable()  # the directory exists, entries/ does not yet
    assert cache.prune(max_bytes=1) == (0, 0)
    assert warnings == []
    lookup(cache, Compiler(), 0)

    @contextlib.contextmanager
    def busy(directory: object) -> Iterator[int]:
        raise kernel_cache.lock.LockUnavailable("held by pid 1")
        yield 0

    monkeypatch.setattr(kernel_cache.stats, "locked", busy)
    assert cache.prune(max_bytes=1) == (0, 0)
    assert cache.usage()[0] == 1 and any("held by pid 1" in w for w in warnings)


def test_prune_without_the_lock_that_cannot_scan_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warnings: list[str] = []
    cache = KernelCache(tmp_path / "cache", warn=warnings.append)
    lookup(cache, Compiler(), 0)

    @contextlib.contextmanager
    def broken(directory: object) -> Iterator[int]:
        raise OSError(errno.EIO, "injected")
        yield 0

    def cannot_scan(*args: object) -> tuple[int, int, int]:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(kernel_cache.stats, "locked", broken)
    monkeypatch.setattr(cache, "_evict", cannot_scan)
    assert cache.prune(max_bytes=1) == (0, 0)
    assert any("pruning unlocked" in w for w in warnings)


def test_a_fresh_temp_file_counts_toward_the_budget(tmp_path: Path) -> None:
    """Another writer's temp file takes space now: prune counts it (and leaves it)."""
    cache = KernelCache(tmp_path / "cache")
    for n in range(3):
        lookup(cache, Compiler(), n)
    entries = cache.usage()[1]
    temp = cache.entry_path(key_of(0)).parent / ".tmp-1-0123456789abcdef"
    temp.write_bytes(b"t" * entries)
    removed, _freed = cache.prune(max_bytes=entries)
    assert removed >= 1 and temp.exists()
    assert cache.usage()[1] <= entries
