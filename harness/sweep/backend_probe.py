"""Which capsafe backend the sweep's test processes get, for the report's header.

CAPSAFE_BACKEND is `auto` unless set, and `auto` is a request, not an answer: the
report must say whether the tests ran on the real driver or the simulated device. A
child process resolves it exactly as a test process does (same interpreter, same
environment), so the sweep's own process never initializes CUDA. A suite's conftest
may still pick another backend for itself; the report's GPU section shows what the
neighbour threads found there.
"""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = "from capsafe import driver; print(driver.backend_choice())"


def backend_in_tests(env: dict[str, str] | None = None) -> str:
    """'sim (auto: no NVIDIA driver found ...)', 'cuda (auto: found a GPU)', 'sim (sim
    requested)'; what was requested and why it is unknown when the probe fails."""
    environ = dict(os.environ if env is None else env)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=environ, capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=300,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{_requested(environ)} (not resolved: {exc})"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return lines[-1]
    reason = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return f"{_requested(environ)} (not resolved: {reason})"


def _requested(environ: dict[str, str]) -> str:
    return environ.get("CAPSAFE_BACKEND", "auto").strip().lower() or "auto"
