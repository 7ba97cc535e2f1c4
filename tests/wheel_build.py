"""Helpers for the tests that install capsafe as users do: its wheel, from PyPI's neighbours.

The wheel is built from a copy of the checkout's files, never in the checkout itself:
setuptools builds in `build/` beside the sources, and two xdist workers building there at
once collide (`File exists: build/bdist.../capsafe-....dist-info`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pypi_reason() -> str | None:
    """Why PyPI cannot be reached, or None when it can."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as exc:
        return f"PyPI cannot be reached ({exc})"
    return None


def build_wheel(out: Path) -> Path:
    """capsafe's wheel, built from a private copy of the tracked and untracked files."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    source = out / "src"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
        cwd=out, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = out.glob("capsafe-*.whl")
    return found
