"""capsafe: CUDA-graph capture hazards made impossible by construction.

The public names are re-exported here as their modules land; import from the
modules directly for everything else.
"""

from capsafe.config import FrozenConfig, FrozenConfigError, runtime_config
from capsafe.errors import (
    BackendUnavailable,
    CapsafeError,
    CaptureInvalidated,
    CudaError,
    ForkedProcessError,
    UsageError,
)
from capsafe.handles import CaptureMode, StreamKind

__all__ = [
    "BackendUnavailable",
    "CapsafeError",
    "CaptureInvalidated",
    "CaptureMode",
    "CudaError",
    "ForkedProcessError",
    "FrozenConfig",
    "FrozenConfigError",
    "StreamKind",
    "UsageError",
    "runtime_config",
]
