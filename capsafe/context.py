"""The per-device primary-context cache: `capsafe.device(ordinal)`.

The driver reference-counts a device's primary context, and when the count
drops to zero it tears the context down, which synchronizes the whole device
and frees every allocation, module and graph made in it. Code that retains and
releases around each use (a test fixture, a library call) therefore turns a
release into a device-wide synchronization at an unpredictable moment: exactly
the kind of call that invalidates another thread's capture. So each device's
primary context is retained once per process, here, and never released; the
process exit cleans it up.

The current context is per thread in the driver, and it is shared state: any
library in the process (CuPy, PyTorch, cuda.core, a test fixture unbinding at
teardown) may set it. So `bind()` asks the driver which context is current
(`cuCtxGetCurrent`, a thread-local read in the driver) and sets its own only
when that differs; a cache of "this thread is bound" would go stale the moment
another library changed it, and the next call would fail with
CUDA_ERROR_INVALID_CONTEXT.

Each ordinal the backend reports has its own device and primary context.

A CUDA context does not survive `os.fork`: the child sees the parent's handles
but the driver state behind them is gone. Devices created before a fork refuse
to work in the child with `ForkedProcessError` instead of failing later with
an opaque driver error.
"""

from __future__ import annotations

import os
import threading

from capsafe import _state, driver
from capsafe.backend import Backend
from capsafe.errors import CudaError, ForkedProcessError, UsageError
from capsafe.handles import Context, Device

FORK_REMEDY = "create devices after fork, or use the 'spawn' start method for child processes"


class CudaDevice:
    """One GPU and its primary context, retained once for the life of the process.

    Use `capsafe.device(ordinal)` rather than constructing one: it returns the
    process-wide instance. Constructing directly (tests, the hazard-matrix trials)
    retains the context through the given backend, still without ever releasing it.
    """

    def __init__(self, backend: Backend, ordinal: int = 0) -> None:
        _check_ordinal(ordinal)
        count = backend.device_get_count()
        if not 0 <= ordinal < count:
            raise UsageError(f"device {ordinal} requested but only {count} device(s)")
        self.backend = backend
        self.ordinal = ordinal
        self.handle: Device = backend.device_get(ordinal)
        self.context: Context = backend.primary_ctx_retain(self.handle)
        self._pid = os.getpid()
        self._generation = _fork_generation
        self._name: str | None = None

    def __repr__(self) -> str:
        return f"<CudaDevice {self.ordinal} on {self.backend.name}>"

    def _check_process(self) -> None:
        # The at-fork counter, not os.getpid(): a syscall on every bind costs more than the bind.
        if self._generation != _fork_generation:
            raise ForkedProcessError(
                f"device {self.ordinal} was created in process {self._pid} before a fork and "
                f"its CUDA context is dead in this child ({os.getpid()}); {FORK_REMEDY}"
            )

    def bind(self) -> CudaDevice:
        """Make this device's primary context current in the calling thread (cheap if it is)."""
        self._check_process()
        current = self.backend.ctx_get_current()
        if current is None or current.value != self.context.value:  # not the dataclass ==: slow
            self.backend.ctx_set_current(self.context)
        return self

    make_current = bind

    @property
    def name(self) -> str:
        if self._name is None:
            self.bind()
            self._name = self.backend.device_get_name(self.handle)
        return self._name

    @property
    def compute_capability(self) -> tuple[int, int]:
        self.bind()
        major = self.backend.device_get_attribute(self.handle, "COMPUTE_CAPABILITY_MAJOR")
        minor = self.backend.device_get_attribute(self.handle, "COMPUTE_CAPABILITY_MINOR")
        return major, minor


_lock = threading.Lock()
_devices: dict[int, CudaDevice] = {}
_forked_after_cuda = False  # set in a child whose parent had retained devices
_fork_generation = 0  # how many forks deep this process is: devices of an older one are dead


def _check_ordinal(ordinal: object) -> None:
    if not isinstance(ordinal, int) or isinstance(ordinal, bool):
        raise UsageError(f"a device ordinal is an int, not {ordinal!r}")


def device(ordinal: int = 0) -> CudaDevice:
    """The process-wide device `ordinal`, bound in the calling thread.

    Raises UsageError for an ordinal the machine does not have, and
    ForkedProcessError in a forked child whose parent had already initialized CUDA.
    """
    found = _devices.get(ordinal) if type(ordinal) is int else None  # 1.0 and True hash as 1
    if found is None:
        _check_ordinal(ordinal)
        with _lock:
            found = _devices.get(ordinal)
            if found is None:
                found = _create(ordinal)
                _devices[ordinal] = found
    return found.bind()


def _create(ordinal: int) -> CudaDevice:
    try:
        return CudaDevice(driver.get(), ordinal)
    except CudaError as exc:
        if _forked_after_cuda:
            raise ForkedProcessError(
                f"this process was forked after its parent initialized CUDA, and the driver "
                f"refuses it here ({exc}); {FORK_REMEDY}"
            ) from exc
        raise


@_state.on_reset
def _reset(forked: bool) -> None:
    # The parent's devices stay referenced by whoever holds them and refuse on
    # use (pid check); the registry starts empty so nothing hands them out again.
    global _lock, _forked_after_cuda, _fork_generation
    if forked:
        _lock = threading.Lock()
        _fork_generation += 1
        _forked_after_cuda = _forked_after_cuda or bool(_devices)
    _devices.clear()
