"""Whether this process may fork test processes: the fork server's checks before each fork.

A forked child gets a copy of the parent's memory and only the thread that forked.
That is a faithful fresh process only when the parent holds nothing the copy breaks:
no other thread (it may hold a lock the child then waits on forever, the allocator's
or the import lock), and no CUDA context (a context does not survive fork; the child
sees dead handles). Each check answers with the reason the report quotes, or None.

The CUDA check never initialises CUDA itself, so it looks only at traces an
initialisation leaves, and is conservative where it cannot know:

- a file descriptor open on a /dev/nvidia* device: `cuInit` opens /dev/nvidiactl (and
  the UVM device), whatever framework called it; loading libcuda alone opens none;
- capsafe's facade holding a CUDA backend (it called `cuInit`), or capsafe devices
  made before the fork (they refuse to work in a child, `ForkedProcessError`, even
  on the simulated backend, where a fresh process would have made its own);
- torch loaded with `torch.cuda.is_initialized()` true (a query that initialises nothing).

CuPy and cuda.core have no such query; an initialisation of theirs is seen by the
device-file check. Where /proc is missing (not Linux), the device-file and native-thread
checks cannot be made and the answer is a refusal: the server falls back.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

__all__ = ["cuda_in_use", "fork_refusal", "other_threads"]

PROC_SELF = Path("/proc/self")
NVIDIA_DEVICES = "/dev/nvidia"


def fork_refusal() -> str | None:
    """Why this process must not fork a test process now, None when it may."""
    if not hasattr(os, "fork"):
        return "this platform has no os.fork"
    return other_threads() or cuda_in_use()


def other_threads() -> str | None:
    """The threads besides the calling one that are alive, as a reason; None if none are.

    Python threads by name; native ones (a library's thread pool) by count from
    /proc/self/task, since `threading` does not know them."""
    me = threading.current_thread()
    named = sorted(t.name for t in threading.enumerate() if t is not me and t.is_alive())
    if named:
        return f"{len(named)} other thread(s) alive after collection: {', '.join(named)}"
    try:
        tasks = len(os.listdir(PROC_SELF / "task"))
    except OSError:
        return "cannot count this process's native threads (no /proc/self/task)"
    if tasks > 1:
        return f"{tasks - 1} native thread(s) besides the main one alive after collection"
    return None


def cuda_in_use() -> str | None:
    """Why CUDA state exists (or may exist) in this process, None when none does."""
    device = _open_nvidia_device()
    if device:
        return f"CUDA is initialised in this process ({device} is open)"
    capsafe = _capsafe_state()
    if capsafe:
        return capsafe
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        return "CUDA is initialised in this process (torch.cuda.is_initialized())"
    return None


def _open_nvidia_device() -> str | None:
    fds = PROC_SELF / "fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return "an unknown device (no /proc/self/fd to look at)"
    for name in names:
        try:
            target = os.readlink(fds / name)
        except OSError:  # closed since the listing (the listing's own descriptor)
            continue
        if target.startswith(NVIDIA_DEVICES):
            return target
    return None


def _capsafe_state() -> str | None:
    """capsafe's own CUDA state, read from the modules already loaded (imports nothing)."""
    context = sys.modules.get("capsafe.context")
    if context is not None and getattr(context, "_devices", None):
        return "capsafe devices exist in this process (made at import or collection)"
    driver = sys.modules.get("capsafe.driver")
    backend = getattr(driver, "_driver", None)
    if backend is not None and getattr(backend, "name", "") != "sim":
        return f"capsafe's facade initialised the {backend.name} backend in this process"
    return None
