"""Cross-process lock files with a bounded wait that names the holder.

flock on a file under locks/, opened through the directory's descriptor without
following symlinks; anything but a regular file at a lock's name is replaced by one.
The holder writes its pid into the file, so a waiter that gives
up can say who held it, and a waiter whose holder is stopped (SIGSTOP, a debugger,
Ctrl-Z) gives up after STOPPED_GRACE seconds instead of waiting out the whole
timeout. A lock dies with its holder (the kernel releases flock on exit).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator

from capsafe.kernel_cache.dirs import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, NotRegularFile, describe

try:
    import fcntl
except ImportError:  # not POSIX: no single flight, every miss compiles
    fcntl = None  # type: ignore[assignment]

STOPPED_GRACE = 1.0  # seconds a stopped holder is given before a waiter compiles itself
_FIRST_DELAY, _MAX_DELAY = 0.001, 0.05

_held: dict[int, int] = {}  # descriptor -> thread ident, for the at-fork reset
_held_lock = threading.Lock()


class LockUnavailable(Exception):
    """The lock could not be had in time; the message says who held it."""


@contextlib.contextmanager
def held(parent: int, name: str, timeout: float) -> Iterator[None]:
    """Hold lock file `name` under directory descriptor `parent` for the block."""
    if fcntl is None:
        raise LockUnavailable("file locks are not available on this platform")
    deadline = time.monotonic() + timeout
    while True:
        fd = _open(parent, name)
        try:
            _acquire(fd, name, max(deadline - time.monotonic(), 0.0))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        if _still_named(parent, name, fd):
            break
        # Replaced while we waited (a repair below, or `capsafe cache clear`): the lock
        # is whatever file carries the name now, so take that one.
        with contextlib.suppress(OSError):
            os.close(fd)  # closing drops our flock on the orphan
    try:
        with contextlib.suppress(OSError):  # the pid only improves messages
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        owner = os.getpid()
        with _held_lock:
            _held[fd] = threading.get_ident()
        try:
            yield
        finally:
            with _held_lock:
                _held.pop(fd, None)
            if os.getpid() == owner:  # a forked child must not unlock its parent's lock
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _open(parent: int, name: str) -> int:
    """The lock file, a regular file. A symlink, FIFO, socket or directory at its name
    is removed and a fresh file made in its place: left there, it would refuse the lock
    (and with the statistics lock, eviction) for good. locks/ is a private directory,
    so whatever stood there was this user's. NotRegularFile if it comes back at once.
    """
    for attempt in range(2):
        try:
            fd = os.open(name, _OPEN_FLAGS, 0o600, dir_fd=parent)
        except OSError as exc:
            if attempt or exc.errno not in _NOT_A_FILE:
                raise
        else:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                return fd
            os.close(fd)
            if attempt:
                raise NotRegularFile(errno.EINVAL, describe(mode), name)
        _remove_non_regular(parent, name)
    raise AssertionError("unreachable")  # pragma: no cover


_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC
# open() of a symlink with O_NOFOLLOW, a directory for writing, a socket
_NOT_A_FILE = frozenset({errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP})


def _remove_non_regular(parent: int, name: str) -> None:
    """Remove `name` unless it is (by now) a regular file: another process's repair
    may just have made one, and that file may be locked."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        return
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=parent)  # never follows a symlink inside it
        else:
            os.unlink(name, dir_fd=parent)  # the link itself, never its target


def _still_named(parent: int, name: str, fd: int) -> bool:
    """True when `name` is still the file we hold open (and so the file others lock)."""
    try:
        now = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def _acquire(fd: int, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    delay = _FIRST_DELAY
    stopped_since: float | None = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = _holder(fd)
        now = time.monotonic()
        if holder is not None and process_state(holder) in ("T", "t"):
            stopped_since = now if stopped_since is None else stopped_since
            if now - stopped_since >= STOPPED_GRACE:
                raise LockUnavailable(f"{name} is held by pid {holder}, which is stopped")
        else:
            stopped_since = None
        if now >= deadline:
            who = f"pid {holder}" if holder is not None else "another process"
            raise LockUnavailable(f"{name} is still held by {who} after {timeout:g} s")
        time.sleep(min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 2, _MAX_DELAY)


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter of `pid` from /proc (R, S, T, ...), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    _, _, rest = text.rpartition(")")  # the command name may hold spaces and parentheses
    fields = rest.split()
    return fields[0] if fields else None


def reset_after_fork() -> None:
    """In a forked child: drop the locks other parent threads held (their threads are gone).

    The child shares each lock's open file description with the parent, so keeping
    the descriptor would keep the lock held for as long as the child lives.
    """
    global _held_lock
    _held_lock = threading.Lock()
    me = threading.get_ident()
    for fd, owner in list(_held.items()):
        if owner != me:
            with contextlib.suppress(OSError):
                os.close(fd)
            del _held[fd]
