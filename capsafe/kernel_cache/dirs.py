"""Paths under the cache root, reached without following a symlink or blocking on a FIFO.

Every directory below the root is opened relative to its parent's descriptor with
O_NOFOLLOW|O_DIRECTORY, and every file is lstat'ed, then opened with O_NOFOLLOW|O_NONBLOCK
and checked to be the same regular file. Only digest-named files in digest-named
directories are ever listed or removed, so nothing planted in the tree (a symlink to a
user's directory, a file under some other name) is read, written through or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
DIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
READ_FLAGS = os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC

ENTRY_NAME = re.compile(r"[0-9a-f]{64}")
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
TEMP_NAME = re.compile(r"\.tmp-\d+-[0-9a-f]{16}")
LOCK_NAME = re.compile(r"[0-9a-f]{64}\.lock")


class NotRegularFile(OSError):
    """A symlink, FIFO, device or directory where a cache file belongs."""


def open_root(path: str | os.PathLike[str]) -> int:
    """The cache root (configured by the user, so a symlink to it is followed)."""
    return os.open(path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)


def open_dir(parent: int, name: str, create: bool) -> int:
    """Directory `name` under `parent`, never through a symlink.

    With `create`, a missing one is made and anything else under that name (a
    planted symlink or file; our directory is private) is replaced by a directory.
    """
    if create:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent)
        else:
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=parent)  # removes the link itself, never its target
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=parent)
    # O_NOFOLLOW|O_DIRECTORY: a symlink (ELOOP) or non-directory (ENOTDIR) is refused here
    return os.open(name, DIR_FLAGS, dir_fd=parent)


@contextlib.contextmanager
def opened(root: str | os.PathLike[str], names: tuple[str, ...], create: bool) -> Iterator[int]:
    """The descriptor of root/names..., every descriptor closed afterwards.

    The first name is opened by its full path with O_NOFOLLOW (one open fewer on the
    hit path); the root's own path may hold symlinks, the user configured it.
    """
    if names and not create:
        fds = [os.open(os.path.join(root, names[0]), DIR_FLAGS)]
        names = names[1:]
    else:
        fds = [open_root(root)]
    try:
        for name in names:
            fds.append(open_dir(fds[-1], name, create))
        yield fds[-1]
    finally:
        for fd in reversed(fds):
            with contextlib.suppress(OSError):
                os.close(fd)


def open_path(root: str | os.PathLike[str], names: tuple[str, ...]) -> int:
    """The descriptor of existing directory root/names..., never through a symlink below root.

    The hit path's version of `opened`: intermediate descriptors are closed at once
    (a descriptor opened relative to a directory stays valid without it).
    """
    fd = os.open(os.path.join(root, names[0]), DIR_FLAGS)
    for name in names[1:]:
        try:
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        fd = child
    return fd


def describe(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def read_file(parent: int, name: str, touch: bool = False) -> bytes:
    """All of regular file `name`; NotRegularFile for anything else, OSError as it comes.

    `touch` marks a use (LRU eviction goes by mtime). A close that fails (EIO, ESTALE
    on NFS) raises like any other error: the caller treats the read as failed.
    """
    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, describe(st.st_mode), name)
    fd = os.open(name, READ_FLAGS, dir_fd=parent)
    closed = False
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise NotRegularFile(errno.EINVAL, "replaced while opening", name)
        data = read_all(fd, now.st_size)
        if touch:
            with contextlib.suppress(OSError):
                os.utime(fd)
        closed = True
        os.close(fd)
    finally:
        if not closed:
            with contextlib.suppress(OSError):
                os.close(fd)
    return data


def read_all(fd: int, size: int) -> bytes:
    chunks, remaining = [], size + 1  # one byte more: a file that grew is caught too
    while remaining > 0:
        chunk = os.read(fd, remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def write_new(parent: int, name: str, data: bytes) -> None:
    """Create `name` (which must not exist) holding `data`; a failed close raises.

    On failure the file it created is removed; anything already there is never touched.
    """
    fd = os.open(name, CREATE_FLAGS, 0o600, dir_fd=parent)
    closed = False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        closed = True
        os.close(fd)
    except BaseException:
        if not closed:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent)
        raise


def replace_with(parent: int, name: str, temp: str, data: bytes) -> None:
    """Put `data` at `name` in one step: written to the new file `temp`, renamed over `name`.

    Readers see the old file or the new one, never a part of it; on failure `temp` is
    removed and `name` left as it was. No fsync: a crash can at worst leave a torn file,
    which every reader here checks for; fsync would cost milliseconds per write.
    """
    write_new(parent, temp, data)
    try:
        os.replace(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=parent)
        raise


def regular_size(parent: int, name: str) -> int:
    """The size of regular file `name`, 0 when it is missing or anything else."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


@dataclass(frozen=True)
class Found:
    """A digest-named entry or a temp file, with the directory descriptor it lives in."""

    parent: int
    shard: str  # "ab/cd"
    name: str
    st: os.stat_result

    @property
    def temp(self) -> bool:
        return self.name.startswith(".tmp-")


def walk(entries: int) -> Iterator[Found]:
    """Regular files named like entries (or temp files) in entries/<xx>/<yy>/, no symlinks."""
    for top in _shards(entries):
        with _shard(entries, top) as top_fd:
            if top_fd is None:
                continue
            for mid in _shards(top_fd):
                with _shard(top_fd, mid) as mid_fd:
                    if mid_fd is None:
                        continue
                    prefix = top + mid
                    for name, st in _files(mid_fd):
                        if TEMP_NAME.fullmatch(name) or (
                            ENTRY_NAME.fullmatch(name) and name.startswith(prefix)
                        ):
                            yield Found(mid_fd, f"{top}/{mid}", name, st)


def _shards(fd: int) -> list[str]:
    try:
        with os.scandir(fd) as it:
            return [e.name for e in it if SHARD_NAME.fullmatch(e.name)]
    except OSError:
        return []


@contextlib.contextmanager
def _shard(parent: int, name: str) -> Iterator[int | None]:
    try:
        fd = open_dir(parent, name, create=False)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _files(fd: int) -> list[tuple[str, os.stat_result]]:
    found = []
    try:
        names = os.listdir(fd)
    except OSError:
        return []
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            found.append((name, st))
    return found
