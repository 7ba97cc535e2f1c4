"""Where a thread is and who holds the gate, as text: the gate's timeout messages and call sites.

The gate decides *who* holds it (`CaptureGate.holders`); this module finds
*where* (call sites from frames, the caller outside capsafe) and writes the
one-line messages its timeouts raise. `config` uses the same frame walker to
say where a setting was frozen. Nothing here is on the shared-section hot path:
sites are kept as (code, line) pairs and formatted only when someone reads them.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(threading.__file__)) + os.sep

Site = tuple[Any, int] | None  # (code object, line): formatted only when someone reads it


@dataclass(frozen=True)
class Holder:
    """One thread that holds (or waits for) the gate, as seen at one instant."""

    thread_name: str
    thread_id: int
    role: str  # "shared", "capture", "waiting capture" or "granted entry"
    depth: int  # nested shared sections (0 for a capture with none)
    site: str  # the outermost call site outside capsafe, or "?"
    now_at: str  # where the thread is executing right now
    exited: bool = False  # the thread has ended (a capture it began is still open)

    def describe(self) -> str:
        text = f"thread {self.thread_name!r} ({self.role}"
        if self.depth:
            text += f", {self.depth} section{'s' if self.depth > 1 else ''}"
        if self.exited:
            return text + f", entered at {self.site}; the owner thread has exited)"
        return text + f", entered at {self.site}, now at {self.now_at})"


def _in_package(frame: Any) -> bool:
    return _is_package_file(frame.f_code.co_filename)


@functools.lru_cache(maxsize=4096)
def _is_package_file(filename: str) -> bool:
    """Cached: every capture's begin asks it of its caller's file, and `abspath` reads the
    working directory (a system call) each time; a third of what a protected
    `torch.cuda.graph` capture cost capsafe."""
    return filename.startswith(_PACKAGE_DIR) or os.path.abspath(filename).startswith(_PACKAGE_DIR)


def outside_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame from `frame` outward that is not capsafe's own code (None: none)."""
    while frame is not None and _in_package(frame):
        frame = frame.f_back
    return frame


def site_of(frame: Any) -> Site:
    return None if frame is None else (frame.f_code, frame.f_lineno)


def outer_site(frame: Any) -> Site:
    """The innermost frame outside the capsafe package: the caller's own line."""
    # `outside_frame` and `site_of` inline, and the cached file test called directly:
    # every capture's begin comes here, and a Python call per capsafe frame on its stack
    # was a tenth of what a protected `torch.cuda.graph` capture cost capsafe.
    outside = frame
    while outside is not None and _is_package_file(outside.f_code.co_filename):
        outside = outside.f_back
    if outside is None:
        outside = frame
    return None if outside is None else (outside.f_code, outside.f_lineno)


def holder_site(frame: Any) -> Site:
    """Where a thread entered the gate, from its live stack: the caller of its outermost
    capsafe frame, else (a bare `with gate:`) its innermost frame outside the stdlib."""
    outermost = None
    f = frame
    while f is not None:
        if _in_package(f):
            outermost = f
        f = f.f_back
    if outermost is not None:
        return site_of(outermost.f_back or outermost)
    f = frame
    while f is not None and f.f_code.co_filename.startswith(_STDLIB_DIR):
        f = f.f_back
    return site_of(f if f is not None else frame)


def format_site(site: Site) -> str:
    if site is None:
        return "?"
    code, line = site
    return f"{_short(code.co_filename)}:{line} in {code.co_name}"


def _short(path: str) -> str:
    cwd = os.getcwd()
    return os.path.relpath(path, cwd) if path.startswith(cwd) else path


_frames_lock = threading.Lock()  # two callers must not interleave pausing the collector


def current_frames() -> dict[int, Any]:
    """`sys._current_frames()` with the collector paused. On CPython before 3.12 it holds
    the runtime's thread-list lock while it makes frame objects; a collection they
    trigger can free a `threading.local`, whose finalizer takes that lock again, and the
    process hangs (reproduced on 3.11.7: tests/core/test_gate_regressions.py)."""
    with _frames_lock:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames()
        finally:
            if enabled:
                gc.enable()


def held_by(holders: Iterable[Holder]) -> str:
    """The holders as one clause of a timeout message."""
    return "; ".join(h.describe() for h in holders) or "no holder left (it just released)"


def capture_timeout_message(label: str, timeout: float | None, holders: Iterable[Holder]) -> str:
    what = f"capture {label}" if label else "capture"
    return f"capture gate: {what} could not begin within {timeout:g} s; held by {held_by(holders)}"


def shared_timeout_message(
    call: str | None,
    thread_name: str,
    timeout: float | None,
    capture_label: str,
    holders: Iterable[Holder],
) -> str:
    what = f" ({capture_label})" if capture_label else ""
    return (
        f"capture gate: {call or 'a gated call'} on thread {thread_name!r} could not "
        f"enter within {timeout:g} s: a capture{what} holds or waits for the "
        f"gate; held by {held_by(holders)}"
    )
