"""SIGTERM and SIGHUP stop a sweep the way Ctrl-C does.

A cancelled CI job, `timeout`, systemd or a closed terminal sends SIGTERM or SIGHUP;
Python's default for both is to die at once, which leaves every test process the sweep
started (each in its own process group, so the signal does not reach them) running
with nobody to reap them, and no report. Raised as a KeyboardInterrupt instead, the
signal takes the Ctrl-C path: the test processes are killed and the partial report of
what ran is written.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
EXIT_CODE_HELP = (  # exit code 130 in the --help of `capsafe sweep` and `capsafe merge`
    "  130  interrupted (Ctrl-C, SIGTERM or SIGHUP); the test processes are stopped and\n"
    "       the report of what ran is still written"
)
_received: list[str] = []  # the stop signals that arrived in the current block


def how() -> str:
    """What interrupted the sweep, for its note: 'SIGTERM', 'SIGHUP' or else 'Ctrl-C'.

    Asked of the signal rather than of the exception: the interrupt is caught and raised
    anew on its way out of the process that was running.
    """
    return _received[-1] if _received else "Ctrl-C"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _received.append(signal.Signals(signum).name)
    raise KeyboardInterrupt


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """For the block: SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread.

    A signal the process was started with ignored (`nohup` ignores SIGHUP) stays
    ignored; outside the main thread, where Python cannot install handlers, nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, _interrupt)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received.clear()
