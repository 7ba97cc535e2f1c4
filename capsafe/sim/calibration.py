"""What the simulated device reports: the numbers an H200 with driver 580 (CUDA 13.0) gave.

Where each number comes from is tabled in docs/sim.md; `tests/sim/test_sim_calibration.py`
compares them with the GPU. The capture rules are calibrated too, but live in
`capsafe.hazards`, shared with the gate.
"""

from __future__ import annotations

MIB = 1 << 20

DEVICE_NAME = "NVIDIA H200 (simulated)"
DRIVER_VERSION = 13000
TOTAL_MEMORY = 150_109_880_320  # cuMemGetInfo total on the H200, driver 580.159.04 (2026-11-29)
ALLOCATION_GRANULARITY = 2 * MIB
ALIGNMENT = 256  # cuMemAlloc's guaranteed alignment; also the unit of memory accounting
#: Newest PTX ISA each driver version JIT-compiles (PTX ISA 9.0 shipped with CUDA 13.0).
MAX_PTX_ISA = (9, 0)
DEVICE_ATTRIBUTES: dict[str, int] = {
    "COMPUTE_CAPABILITY_MAJOR": 9,
    "COMPUTE_CAPABILITY_MINOR": 0,
    "MULTIPROCESSOR_COUNT": 132,
    "WARP_SIZE": 32,
    "MAX_THREADS_PER_BLOCK": 1024,
    "MAX_BLOCK_DIM_X": 1024,
    "MAX_BLOCK_DIM_Y": 1024,
    "MAX_BLOCK_DIM_Z": 64,
    "MAX_GRID_DIM_X": 2**31 - 1,
    "MAX_GRID_DIM_Y": 65535,
    "MAX_GRID_DIM_Z": 65535,
    "MAX_SHARED_MEMORY_PER_BLOCK": 48 * 1024,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 227 * 1024,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
    "MAX_REGISTERS_PER_BLOCK": 65536,
    "TOTAL_CONSTANT_MEMORY": 64 * 1024,
    "UNIFIED_ADDRESSING": 1,
    "CONCURRENT_KERNELS": 1,
    "MANAGED_MEMORY": 1,
    "MEMORY_POOLS_SUPPORTED": 1,
    "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1,
}
