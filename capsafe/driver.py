"""Choosing the backend and handing out the process-wide driver facade.

`CAPSAFE_BACKEND=cuda|sim|auto` selects. `auto` (the default) takes `cuda` when
a driver and at least one device answer, and `sim` otherwise, and logs which it
took and why, so a CPU-only CI run never mistakes itself for a GPU run.
"""

from __future__ import annotations

import logging
import os
import threading

from capsafe.backend import Backend
from capsafe.errors import BackendUnavailable, UsageError

BACKENDS = ("cuda", "sim", "auto")
log = logging.getLogger("capsafe")

_lock = threading.Lock()
_driver: Backend | None = None
_why = ""


def requested_backend() -> str:
    """The backend named by CAPSAFE_BACKEND (default auto), validated."""
    name = os.environ.get("CAPSAFE_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise UsageError(
            f"CAPSAFE_BACKEND={name!r} is not a backend; use one of: {', '.join(BACKENDS)}"
        )
    return name


def create_backend(name: str) -> tuple[Backend, str]:
    """A new backend of the named kind and a one-line reason for the choice."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; use one of: {', '.join(BACKENDS)}")
    if name == "sim":
        from capsafe.backend_sim import SimBackend

        return SimBackend(), "sim requested"
    from capsafe import backend_cuda

    problem = backend_cuda.unavailable_reason()
    if problem is None:
        return backend_cuda.CudaBackend(), "cuda requested" if name == "cuda" else "auto: found a GPU"
    if name == "cuda":
        raise BackendUnavailable(f"CAPSAFE_BACKEND=cuda but {problem}; use CAPSAFE_BACKEND=sim")
    from capsafe.backend_sim import SimBackend

    return SimBackend(), f"auto: {problem}, using the simulated device"


def get() -> Backend:
    """The process-wide driver, created on first use from CAPSAFE_BACKEND."""
    global _driver, _why
    if _driver is None:
        with _lock:
            if _driver is None:
                backend, _why = create_backend(requested_backend())
                backend.init()
                log.info("capsafe backend: %s (%s)", backend.name, _why)
                _driver = backend
    return _driver


def backend_choice() -> str:
    """Which backend `get()` took and why, e.g. 'sim (auto: no NVIDIA driver ...)'."""
    driver = get()
    return f"{driver.name} ({_why})"


def _reset_after_fork() -> None:
    # The child starts with no driver: a CUDA context does not survive fork.
    global _lock, _driver
    _lock = threading.Lock()
    _driver = None


os.register_at_fork(after_in_child=_reset_after_fork)
