"""Where the sweep's test processes keep their bytecode when the user's environment says
to write none (PYTHONDONTWRITEBYTECODE).

Without bytecode on disk every test process parses and compiles each module it imports
again, and pytest rewrites the asserts of every test module again: 5 of the 8 s one
collection of a 2,000-test synthetic suite took, paid by the sweep's collection, each
suite run's every xdist worker, the fork server and each fresh replay. The variable is there
to keep bytecode out of the project's tree, so the sweep's processes write theirs under its
own raw/pycache instead (PYTHONPYCACHEPREFIX; an empty PYTHONDONTWRITEBYTECODE is unset
for Python), and the project's tree stays as the user asked. A user who set a prefix of
their own, or no PYTHONDONTWRITEBYTECODE, is left as they are.
"""

from __future__ import annotations

import os
from pathlib import Path

PYCACHE = "pycache"
"""raw/pycache: the test processes' bytecode (a resume keeps it; a merge copies none)."""


def bytecode_env(raw: Path) -> dict[str, str]:
    """What the sweep sets on top of the environment of its test processes for bytecode."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return {}
    return {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(raw.absolute() / PYCACHE)}
