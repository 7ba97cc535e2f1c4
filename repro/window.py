"""A capture window that spans the neighbours' calls however slow the machine is.

The planted capture suites hold a capture open while the harness's neighbour threads
(`--capsafe-neighbors`, named `capsafe-neighbor-N`) make driver calls through the gate.
A window of fixed length can close before a loaded machine has run any of them, and the
verdict would then depend on the machine's speed. `hold_open` counts the neighbours'
calls instead: it returns once they have entered the gate `calls` times since the window
opened (an ungated capture: their calls ran inside it), or once every neighbour waits at
the gate (a gated one: their calls were held back), and as soon as no neighbour runs.
Only a hang makes it wait longer: the sweep's per-test timeout is its watchdog.
"""

from __future__ import annotations

import threading
import time

from capsafe.gate import gate

NEIGHBOUR_THREAD = "capsafe-neighbor-"  # harness.plugin.neighbors names its threads so
CALLS = 100  # neighbour calls a window spans: every call kind, several times over
POLL_S = 0.001


def neighbours() -> int:
    """How many neighbour threads run in this process now."""
    return sum(t.name.startswith(NEIGHBOUR_THREAD) for t in threading.enumerate())


def hold_open(calls: int = CALLS) -> None:
    """Keep the caller's capture window open until the neighbours' calls have met it."""
    start = gate().stats()
    while True:
        threads = neighbours()  # one that could not set up has ended
        if not threads:
            return
        now = gate().stats()
        entered = now.shared_entered + now.admitted_measured
        if entered - (start.shared_entered + start.admitted_measured) >= calls:
            return
        if now.contended_waits - start.contended_waits >= threads:
            return
        time.sleep(POLL_S)
