"""Run by tests/core/test_gate_signals.py: `python gate_signal_stress.py alarm|sigint SECONDS`.

The main thread makes shared sections in a loop while a capture loop and an
allocator run on other threads, and is interrupted every few milliseconds by a
SIGALRM handler that raises (pytest-timeout's signal method) or a real SIGINT.
A signal that lands at the very start of `exit()`, before its first instruction, leaves
open the section exit() was called to close, as it would leave any lock written in
Python held (docs/gate.md says so): the handlers see that from the interrupted frame,
and the loop closes that section, as the user's cleanup would. Afterwards nothing may
be left: no section (one left is a section the gate leaked when a signal cut enter() or
exit() short), no grant, no capture; a capture on another thread begins at once.
Signals come one at a time (the next only after the last was handled).
It runs SECONDS and until MIN_INTERRUPTS signals have landed, however slow the machine.
Prints `OK <interrupts> <sections> <captures> cut <n>`, else exits 1 saying what was left.
"""

import dis
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


EXIT = CaptureGate.exit.__code__
EXIT_STARTS = next(i.offset for i in dis.get_instructions(EXIT) if i.opname == "RESUME")
cut_at_exit: list[bool] = []  # one entry per signal: did it land at exit()'s first instruction?


def landed(frame: object) -> None:
    cut_at_exit.append(
        getattr(frame, "f_code", None) is EXIT and getattr(frame, "f_lasti", -1) <= EXIT_STARTS
    )


def fire(signum: int, frame: object) -> None:
    landed(frame)
    raise Fired


def interrupt(signum: int, frame: object) -> None:  # Python's default_int_handler, counted
    landed(frame)
    raise KeyboardInterrupt


go = threading.Event()
handled = threading.Event()
threads = [threading.Thread(target=f, daemon=True) for f in (capture_loop, allocator)]
for t in threads:
    t.start()
if MODE == "alarm":
    signal.signal(signal.SIGALRM, fire)
else:  # real SIGINT from another thread: KeyboardInterrupt in the main thread
    # A process started with SIGINT ignored (a background job, nohup) keeps it ignored
    # and Python installs no handler: install Python's own, or no interrupt lands.
    signal.signal(signal.SIGINT, interrupt)

    def interrupter() -> None:
        go.wait()  # no signal before the main thread is inside its try
        while not stop.is_set():
            time.sleep(random.uniform(0.0005, 0.003))
            handled.clear()
            os.kill(os.getpid(), signal.SIGINT)
            handled.wait(5)  # one at a time: a handler never lands inside another

    threading.Thread(target=interrupter, daemon=True).start()
interrupts = entered = 0
deadline = time.monotonic() + SECONDS
while time.monotonic() < deadline or interrupts < MIN_INTERRUPTS:
    try:
        go.set()
        if MODE == "alarm":  # armed inside the try: it may fire at once
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.003))
        while time.monotonic() < deadline or interrupts < MIN_INTERRUPTS:
            g.enter("mem_alloc")
            try:
                entered += 1
            finally:
                g.exit()
    except (Fired, KeyboardInterrupt):
        interrupts += 1
        if cut_at_exit and cut_at_exit[-1]:
            g.exit()  # the section exit() was called to close
        handled.set()
while True:  # stop the signals; one may still land while we do
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        break
    except (Fired, KeyboardInterrupt):
        interrupts += 1
        if cut_at_exit and cut_at_exit[-1]:
            g.exit()
        handled.set()
for t in threads:
    t.join(10)
cut = sum(cut_at_exit)
left = [h for h in g.stats().holders if h.thread_name == "MainThread"]
if left:
    print("LEAKED", interrupts, f"{cut} signals landed at exit()'s start and were closed;", left)
    sys.exit(1)
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
print("OK", interrupts, entered, stats.captures, "cut", cut)
