"""`SimBackend`: the Backend interface over the simulated devices.

Each method checks, in the driver's order, that the backend is initialized,
that the calling thread has a current context, and whether the hazard table
says the call breaks an open capture; then it works on the current context's
memory (`memory`), streams (`streams`), captures and graphs (`capture`) and
modules (`kernels`). The calls are grouped by what they work on, one module each
(`contexts`: devices, contexts and the entry checks; `stream_calls`; `memory_calls`;
`kernel_calls`); `SimBackend` joins them and makes the state.

All state sits behind one re-entrant lock; nothing in the sim ever blocks while
holding it, so many threads may call at once.
"""

from __future__ import annotations

import itertools
import threading
import weakref

from capsafe import _state
from capsafe.config import MAX_SIM_DEVICES
from capsafe.errors import UsageError
from capsafe.handles import Context, Device
from capsafe.sim.contexts import HANDLE_BASE, DeviceState
from capsafe.sim.kernel_calls import KernelCalls
from capsafe.sim.memory import AddressSpace
from capsafe.sim.memory_calls import MemoryCalls
from capsafe.sim.stream_calls import StreamCalls

_live: weakref.WeakSet[SimBackend] = weakref.WeakSet()


class SimBackend(StreamCalls, MemoryCalls, KernelCalls):
    """Simulated H200s (`devices` of them, default one). Each instance is a separate driver."""

    name = "sim"

    def __init__(self, devices: int = 1) -> None:
        if not isinstance(devices, int) or not 1 <= devices <= MAX_SIM_DEVICES:
            raise UsageError(
                f"the simulated machine has 1 to {MAX_SIM_DEVICES} devices, not {devices!r}"
            )
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._initialized = False
        self._ids = itertools.count(HANDLE_BASE, 0x10)
        self._seq = itertools.count(1)
        self._addresses = AddressSpace()
        self._devices = [
            DeviceState(Device(n, ordinal=n), Context(next(self._ids))) for n in range(devices)
        ]
        _live.add(self)


@_state.on_fork
def _after_fork_in_child() -> None:
    # A thread that held a backend's lock at fork time does not exist in the child: fresh locks.
    for backend in list(_live):
        backend._lock = threading.RLock()
