"""Old import path of the simulated device; it lives in `capsafe.sim` now (import from there)."""

from capsafe.sim import (  # noqa: F401
    KernelStandIn,
    SimBackend,
    SimMemory,
    kernel_standin,
    register_kernel,
    unregister_kernel,
)
