"""Whether this process may fork test processes: the fork server's checks before each fork.

A forked child gets a copy of the parent's memory and only the thread that forked.
That is a faithful fresh process only when the parent holds nothing the copy breaks:
no other thread (it may hold a lock the child then waits on forever, the allocator's
or the import lock), and no CUDA context (a context does not survive fork; the child
sees dead handles). Each check answers with the reason the report quotes, or None.

The CUDA check never initialises CUDA itself, so it looks only at what an
initialisation leaves, and is conservative where it cannot know:

- the CUDA driver library loaded and initialised: where libcuda is mapped into this
  process, `cuDeviceGetCount` through it answers CUDA_ERROR_NOT_INITIALIZED until some
  library called `cuInit` (the query initialises nothing). A descriptor open on a
  /dev/nvidia* device alone is not refused: NVML opens the same devices (torch's
  fork-safe availability check, PYTORCH_NVML_BASED_CUDA_CHECK=1, does), and a child
  forked after it uses CUDA as a fresh process does (measured on the H200, see
  docs/harness.md). Where libcuda cannot be asked, an open device refuses;
- capsafe's facade holding a CUDA backend (it called `cuInit`), or capsafe devices
  made before the fork (they refuse to work in a child, `ForkedProcessError`, even
  on the simulated backend, where a fresh process would have made its own);
- torch loaded with `torch.cuda.is_initialized()` true (a query that initialises nothing).

Native threads are counted from /proc/self/task; those of a loaded OpenBLAS's pool are
allowed (see `_openblas_workers`), and NVML's one (NVML_THREAD), any others refuse.

CuPy and cuda.core have no such query; an initialisation of theirs is seen by the
driver's own answer. Where /proc is missing (not Linux), the driver and native-thread
checks cannot be made and the answer is a refusal: the server falls back.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

__all__ = ["cuda_in_use", "fork_refusal", "other_threads"]

PROC_SELF = Path("/proc/self")
NVIDIA_DEVICES = "/dev/nvidia"
CUDA_DRIVER = "libcuda.so"  # the driver API library, whatever its version suffix
CUDA_ERROR_NOT_INITIALIZED = 3
NVML_THREAD = "cuda0000"
"""The name NVML gives the thread it starts on first use (measured on the H200: torch's
NVML-based `is_available()` leaves one, `cuda00001800007`). With the driver uninitialised
(`cuda_in_use` is asked first) it can only be NVML's, and a child never calls NVML's
state through it: a child forked beside it used CUDA (docs/harness.md)."""
OPENBLAS_PREFIXES = ("", "scipy_")  # OpenBLAS's own build, and numpy's and SciPy's wheels


def fork_refusal() -> str | None:
    """Why this process must not fork a test process now, None when it may."""
    if not hasattr(os, "fork"):
        return "this platform has no os.fork"
    return cuda_in_use() or other_threads()  # CUDA first: its driver threads say less


def other_threads() -> str | None:
    """The threads besides the calling one that are alive, as a reason; None if none are.

    Python threads by name; native ones (a library's thread pool) by count from
    /proc/self/task, since `threading` does not know them."""
    me = threading.current_thread()
    named = sorted(t.name for t in threading.enumerate() if t is not me and t.is_alive())
    if named:
        return f"{len(named)} other thread(s) alive after collection: {', '.join(named)}"
    try:
        tasks = os.listdir(PROC_SELF / "task")
    except OSError:
        return "cannot count this process's native threads (no /proc/self/task)"
    nvml = sum(1 for task in tasks if _thread_name(task).startswith(NVML_THREAD))
    native = len(tasks) - 1 - nvml
    if native > _openblas_workers():
        return f"{native} native thread(s) besides the main one alive after collection"
    return None


def _thread_name(task: str) -> str:
    try:
        return (PROC_SELF / "task" / task / "comm").read_text().strip()
    except OSError:  # ended since the listing
        return ""


def _openblas_workers() -> int:
    """How many worker threads a loaded OpenBLAS may run (0 without one): numpy starts
    them on import. They are not a fork hazard: OpenBLAS stops its pool in the parent
    before every fork (its pthread_atfork handler) and restarts it on use. Native
    threads cannot be told apart, so up to this many are taken to be its workers."""
    try:
        maps = (PROC_SELF / "maps").read_text()
    except OSError:
        return 0
    libraries = {line.split()[-1] for line in maps.splitlines() if "openblas" in line.lower()}
    for path in sorted(p for p in libraries if p.startswith("/")):
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        for prefix in OPENBLAS_PREFIXES:
            for suffix in ("", "64_"):
                query = getattr(library, f"{prefix}openblas_get_num_threads{suffix}", None)
                if query is not None:
                    return max(0, int(query()) - 1)  # the calling thread is the pool's first
    return 0


def cuda_in_use() -> str | None:
    """Why CUDA state exists (or may exist) in this process, None when none does."""
    driver = _initialised_driver()
    if driver:
        return driver
    capsafe = _capsafe_state()
    if capsafe:
        return capsafe
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        return "CUDA is initialised in this process (torch.cuda.is_initialized())"
    return None


def _initialised_driver() -> str | None:
    """Why `cuInit` ran (or may have run) here: a loaded libcuda that says so, or, where no
    loaded libcuda can be asked, a /dev/nvidia* descriptor; None when neither."""
    initialised = "CUDA is initialised in this process"
    try:
        maps = (PROC_SELF / "maps").read_text()
    except OSError:
        return "CUDA may be initialised in this process (no /proc/self/maps to look at)"
    libraries = sorted({line.split()[-1] for line in maps.splitlines()
                        if CUDA_DRIVER in line.rsplit("/", 1)[-1]})  # fmt: skip
    asked = False
    for path in libraries:
        answer = _driver_answer(path)
        if answer is None:
            continue
        asked = True
        if answer != CUDA_ERROR_NOT_INITIALIZED:
            return f"{initialised} ({path} answers cuDeviceGetCount with {answer})"
    if asked or not libraries:
        return None  # no driver loaded, or every loaded one uninitialised: devices are NVML's
    device = _open_nvidia_device()
    return f"{initialised} ({device} is open)" if device else None


def _driver_answer(path: str) -> int | None:
    """`cuDeviceGetCount`'s status from the already loaded driver at `path` (it loads
    nothing new), None when it cannot be asked."""
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        query = library.cuDeviceGetCount
    except (OSError, AttributeError):
        return None
    count = ctypes.c_int(0)
    return int(query(ctypes.byref(count)))


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
    if backend is not None:  # capsafe's fork hook gives a child a new one: an object that
        # kept the server's (a conftest's fake framework over driver.raw()) would diverge
        name = getattr(backend, "name", "?")
        return f"capsafe's driver ({name} backend) was made at import or collection"
    return None
