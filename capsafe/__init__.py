"""capsafe: CUDA-graph capture hazards made impossible by construction.

The names most code needs; everything else lives in its own module
(`capsafe.driver`, `capsafe.nvrtc`, `capsafe.kernel_cache`, `capsafe.hazards`).
Importing capsafe loads no CUDA library: the driver is opened on first use.
"""

from capsafe.capture import Capture, capture
from capsafe.config import FrozenConfig, FrozenConfigError, runtime_config
from capsafe.context import device
from capsafe.errors import (
    BackendUnavailable,
    CapsafeError,
    CaptureInvalidated,
    CudaError,
    ForkedProcessError,
    UsageError,
)
from capsafe.gate import CaptureGate, GateTimeout
from capsafe.handles import CaptureMode, StreamKind
from capsafe.streams import TestStream

__all__ = [
    "BackendUnavailable",
    "CapsafeError",
    "Capture",
    "CaptureGate",
    "CaptureInvalidated",
    "CaptureMode",
    "CudaError",
    "ForkedProcessError",
    "FrozenConfig",
    "FrozenConfigError",
    "GateTimeout",
    "StreamKind",
    "TestStream",
    "UsageError",
    "capture",
    "device",
    "runtime_config",
]
