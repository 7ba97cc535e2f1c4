"""capsafe: CUDA-graph capture hazards made impossible by construction.

The names most code needs; everything else lives in its own module
(`capsafe.driver`, `capsafe.nvrtc`, `capsafe.kernel_cache`, `capsafe.hazards`).

Importing capsafe is cheap and loads no CUDA library: the names below are
imported from their modules on first use, so a test process that only touches
`capsafe.config` (as the harness plugin does) does not pay for the driver
facade, and the driver itself is opened only when something calls it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from capsafe.errors import (
    BackendUnavailable,
    CapsafeError,
    CaptureInvalidated,
    CudaError,
    ForkedProcessError,
    UsageError,
)

if TYPE_CHECKING:
    from capsafe.capturing import Capture, capture
    from capsafe.config import FrozenConfig, FrozenConfigError, runtime_config
    from capsafe.context import device
    from capsafe.gate import CaptureGate, GateTimeout
    from capsafe.handles import CaptureMode, StreamKind
    from capsafe.streams import TestStream

_LAZY = {
    "Capture": "capsafe.capturing",
    "capture": "capsafe.capturing",
    "CaptureGate": "capsafe.gate",
    "GateTimeout": "capsafe.gate",
    "FrozenConfig": "capsafe.config",
    "FrozenConfigError": "capsafe.config",
    "runtime_config": "capsafe.config",
    "device": "capsafe.context",
    "CaptureMode": "capsafe.handles",
    "StreamKind": "capsafe.handles",
    "TestStream": "capsafe.streams",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'capsafe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


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
