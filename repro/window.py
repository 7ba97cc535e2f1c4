"""A capture window that spans the neighbours' calls however slow the machine is.

The planted capture suites hold a capture open while the harness's neighbour threads
(`--capsafe-neighbors`, named `capsafe-neighbor-N`) make driver calls through the gate.
A window of fixed length can close before a loaded machine has run any of them, and the
verdict would then depend on the machine's speed. `hold_open` counts instead: it returns
once the neighbours have entered the gate `calls` times since the window opened (an
ungated capture: their calls ran inside it), or, in a gated capture, once every
neighbour is parked at the gate (their calls are held back), and as soon as no neighbour
runs. Only a hang makes it wait longer: the sweep's per-test timeout is its watchdog.
"""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType

from capsafe import gate as gate_module
from capsafe.gate import gate

NEIGHBOUR_THREAD = "capsafe-neighbor-"  # harness.plugin.neighbors names its threads so
CALLS = 100  # neighbour calls an ungated window spans: every call kind, several times over
POLL_S = 0.001


def neighbours() -> list[threading.Thread]:
    """The neighbour threads running in this process now."""
    return [t for t in threading.enumerate() if t.name.startswith(NEIGHBOUR_THREAD)]


def _at_gate(frame: FrameType | None) -> bool:
    """Is the thread in the gate's code? While a gated capture is open no other thread holds
    a section, so one in there is waiting to enter."""
    while frame is not None:
        if frame.f_code.co_filename == gate_module.__file__:
            return True
        frame = frame.f_back
    return False


def hold_open(calls: int = CALLS) -> None:
    """Keep the caller's capture window open until the neighbours' calls have met it."""
    start = gate().stats()
    gated = start.open_captures > 0  # the caller's capture holds the gate
    began = start.shared_entered + start.admitted_measured
    while True:
        threads = neighbours()  # one that could not set up has ended
        if not threads:
            return
        now = gate().stats()
        if now.shared_entered + now.admitted_measured - began >= calls:
            return
        frames = sys._current_frames()
        if gated and all(_at_gate(frames.get(t.ident or 0)) for t in threads):
            return
        time.sleep(POLL_S)
