"""Optional pytest plugins the sweep keeps out of its test processes when they are installed.

pytest-run-parallel (the `capsafe[threads]` extra, used by `--threads`) prints a
line into every pytest session and imports numpy when loaded; capsafe never
needs it otherwise. Blocking it is asked for only where it is installed, so a
command line the report prints carries no option for a plugin that is not there.
"""

from __future__ import annotations

import functools
import importlib.util

RUN_PARALLEL_MODULE = "pytest_run_parallel"
RUN_PARALLEL_PLUGIN = "run-parallel"  # its pytest11 entry point name


@functools.cache
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def quiet_plugin_args(threads: int) -> list[str]:
    """`-p no:run-parallel` when pytest-run-parallel is installed and `threads` does not use it."""
    if threads > 1 or not _installed(RUN_PARALLEL_MODULE):
        return []
    return ["-p", f"no:{RUN_PARALLEL_PLUGIN}"]
