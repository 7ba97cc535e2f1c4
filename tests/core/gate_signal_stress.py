"""Run by tests/core/test_gate_signals.py: `python gate_signal_stress.py alarm|sigint SECONDS`.

The main thread makes shared sections in a loop while a capture loop and an
allocator run on other threads, and is interrupted every few milliseconds by a
SIGALRM handler that raises (pytest-timeout's signal method) or a real SIGINT.
Afterwards nothing may be left but the main thread's own sections that a signal cut off
at `with`'s call of __exit__ (closed here, as the user's cleanup would): a capture on
another thread begins at once and no holder is named.
It runs SECONDS and until MIN_INTERRUPTS signals have landed, however slow the machine.
Prints `OK <interrupts> <sections> <captures>`, else exits 1 saying what was left.
"""

import os
import random
import signal
import sys
import threading
import time

from capsafe.gate import CaptureGate, GateTimeout

MODE, SECONDS = sys.argv[1], float(sys.argv[2])
MIN_INTERRUPTS = 100
g = CaptureGate(fairness_s=0.001, shared_timeout=10)
stop = threading.Event()


def capture_loop() -> None:
    while not stop.is_set():
        with g.begin_capture(timeout=10):
            time.sleep(0.0002)


def allocator() -> None:
    while not stop.is_set():
        with g.shared("mem_alloc"):
            pass


class Fired(Exception):
    """What pytest-timeout's signal method raises from its SIGALRM handler."""


def fire(signum: int, frame: object) -> None:
    raise Fired


go = threading.Event()
threads = [threading.Thread(target=f, daemon=True) for f in (capture_loop, allocator)]
for t in threads:
    t.start()
if MODE == "alarm":
    signal.signal(signal.SIGALRM, fire)
else:  # real SIGINT from another thread: KeyboardInterrupt in the main thread
    # A process started with SIGINT ignored (a background job, nohup) keeps it ignored
    # and Python installs no handler: install Python's own, or no interrupt lands.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupter() -> None:
        go.wait()  # no signal before the main thread is inside its try
        while not stop.is_set():
            time.sleep(random.uniform(0.0005, 0.003))
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupter, daemon=True).start()
interrupts = entered = 0
deadline = time.monotonic() + SECONDS
while time.monotonic() < deadline or interrupts < MIN_INTERRUPTS:
    try:
        go.set()
        if MODE == "alarm":  # armed inside the try: it may fire at once
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.003))
        while time.monotonic() < deadline or interrupts < MIN_INTERRUPTS:
            with g.shared("mem_alloc"):
                entered += 1
    except (Fired, KeyboardInterrupt):
        interrupts += 1
while True:  # stop the signals; one may still land while we do
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        break
    except (Fired, KeyboardInterrupt):
        interrupts += 1
for t in threads:
    t.join(10)
# A signal that lands as `with` calls the section's __exit__ (the check for pending
# signals at the start of any Python function) leaves that section open, as it would
# leave any lock written in Python held; docs/gate.md says so. Those are the main
# thread's own sections: the user's cleanup closes them. Anything else left behind
# (a grant, a capture, another thread's section) is the gate's fault.
boundary = [h for h in g.stats().holders if h.thread_name == "MainThread" and h.role == "shared"]
for holder in boundary:
    for _ in range(holder.depth):
        g.exit()
began: list[BaseException | None] = []


def capture_elsewhere() -> None:
    try:
        g.begin_capture(timeout=5).release()
        began.append(None)
    except GateTimeout as exc:
        began.append(exc)


probe = threading.Thread(target=capture_elsewhere)
probe.start()
probe.join(10)
if began != [None]:
    print("WEDGED", interrupts, began)
    sys.exit(1)
stats = g.stats()
if stats.holders or stats.open_captures:
    print("LEFT", interrupts, stats.holders)
    sys.exit(1)
print("OK", interrupts, entered, stats.captures, "boundary", sum(h.depth for h in boundary))
