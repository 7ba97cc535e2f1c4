"""The simulated device: an in-process model of NVIDIA H200s behind the `Backend` facade.

It exists so everything above the driver runs, and is tested, on machines
without a GPU; docs/sim.md says what it models and what it is calibrated
against. By concern:

- `calibration`: what the device and driver report (name, limits, memory, versions);
- `memory`: real bytes behind fake addresses, allocations, VMM, accounting;
- `streams`: lazy per-stream work queues and the legacy stream's implicit sync;
- `capture`: captures, graphs, and the hazard table applied to every call;
- `kernels`: module images, launch limits, Python kernel stand-ins;
- the driver calls over all of the above, by what they work on: `contexts` (devices,
  contexts, and the checks every call makes first), `stream_calls`, `memory_calls`,
  `kernel_calls`; `backend`: `SimBackend`, which joins them.
"""

from __future__ import annotations

from capsafe.sim.backend import SimBackend
from capsafe.sim.kernels import (
    KernelStandIn,
    SimMemory,
    kernel_standin,
    register_kernel,
    unregister_kernel,
)

__all__ = [
    "KernelStandIn",
    "SimBackend",
    "SimMemory",
    "kernel_standin",
    "register_kernel",
    "unregister_kernel",
]
