"""Framework integrations: CuPy, cuda.core and PyTorch capture through the capture gate.

Each integration is a module imported on demand (`capsafe.integrations.cupy`,
`capsafe.integrations.cuda_core`, `capsafe.integrations.torch`); importing this
package or any of them imports no framework: that happens in `install()` or `capture()`.
See docs/integrations.md for what each one hooks and what cannot be hooked.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from capsafe.errors import UsageError

#: The integrations, by the name `--capsafe-protect` takes.
NAMES = ("cupy", "cuda_core", "torch")


def module(name: str) -> ModuleType:
    """The integration module called `name`; a one-line UsageError for an unknown name."""
    if name not in NAMES:
        raise UsageError(f"unknown integration {name!r}; use one of: {', '.join(NAMES)}")
    return importlib.import_module(f"capsafe.integrations.{name}")
