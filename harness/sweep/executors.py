"""The executor `capsafe sweep --executor NAME` names.

Apart from executor.py so that the local pool and the Ray executor, which builds on the
local one's `WatchedProcess`, never import each other.
"""

from __future__ import annotations

from .executor import Executor, LocalExecutor
from .options import SweepError

EXECUTORS = ("local", "ray")


def make_executor(name: str, address: str | None = None, *, gpus: bool = False) -> Executor:
    """The executor `capsafe sweep --executor NAME [--address ADDR] [--gpus ...]` asks for."""
    if name == "local":
        return LocalExecutor()
    if name == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor.connect(address, gpus=gpus)
    raise SweepError(f"--executor must be one of {', '.join(EXECUTORS)}, got {name!r}")
