"""Allocator threads invalidate a capture on another thread; the capture gate stops it.

The main thread captures in a loop (begin, one memset into the graph, end; every
1000th graph is also instantiated) while N threads allocate and free device
memory, or with --hazards cycle through every call the hazard table says can
break a capture. In GLOBAL mode (PyTorch's default) an ungated allocation on
another thread fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and kills the
capture that is open at that moment. With --gate on every such call waits for
the capture window to close, and no capture is lost.

Exit status: 0 when the run shows what it should (with --gate on: no capture
invalidated and no allocator call failed; with --gate off the counts are the
demonstration), 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .cli import device_facts, finish, reproducer_parser, run_main, select_backend

BUFFER_BYTES = 4096
INSTANTIATE_EVERY = 1000


@dataclass
class Tally:
    """What one run saw; `as_dict` is the JSON and the printed summary."""

    captures: int = 0
    captured: int = 0
    invalidations: int = 0
    first_invalidation_s: float | None = None
    first_invalidation: str = ""
    instantiated: int = 0
    capture_errors: Counter[str] = field(default_factory=Counter)
    allocator_calls: list[int] = field(default_factory=list)
    allocator_errors: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "captures": self.captures,
            "captured": self.captured,
            "invalidations": self.invalidations,
            "first_invalidation_s": self.first_invalidation_s,
            "first_invalidation": self.first_invalidation,
            "instantiated": self.instantiated,
            "capture_errors": dict(self.capture_errors),
            "allocator_calls": sum(self.allocator_calls),
            "allocator_calls_per_thread": list(self.allocator_calls),
            "allocator_errors": sum(self.allocator_errors.values()),
            "allocator_errors_by_result": dict(self.allocator_errors),
        }


def allocator(
    drv: Any,
    index: int,
    tally: Tally,
    stop: threading.Event,
    capturing: Any,
    hazards: bool,
    ready: threading.Barrier,
) -> None:
    """Make capture-breaking calls until `stop`, counting calls and errors.

    With `hazards`, every capture-breaking action of `capsafe.hazards.actions`
    in turn; otherwise `mem_alloc_free` only.
    """
    from capsafe.context import device
    from capsafe.errors import CudaError
    from capsafe.hazards.actions import BREAKING, BY_NAME, ActionKit

    device(0)  # binds the context in this thread
    kit = ActionKit(drv, capturing=capturing)
    actions = BREAKING if hazards else (BY_NAME["mem_alloc_free"],)
    ready.wait()
    calls = 0
    try:
        for action in itertools.cycle(actions):
            if stop.is_set():
                break
            try:
                kit.run(action)
            except CudaError as exc:
                tally.allocator_errors[exc.result] += 1
            calls += 1
            tally.allocator_calls[index] = calls
    finally:
        stop.wait()  # the kit's teardown must not break the captures still running
        kit.close()


def capture_loop(
    drv: Any, stream: Any, mode: str, seconds: float, tally: Tally, start: float
) -> None:
    """Capture until `seconds` have passed; count what happened to each capture."""
    from capsafe.capturing import Capture
    from capsafe.errors import CaptureInvalidated, CudaError

    buf = drv.mem_alloc(BUFFER_BYTES)
    deadline = start + seconds
    try:
        while time.monotonic() < deadline:
            tally.captures += 1
            try:
                with Capture(stream, mode, drv) as cap:
                    drv.memset_d8_async(buf, tally.captures & 0xFF, BUFFER_BYTES, stream)
            except CaptureInvalidated as exc:
                tally.invalidations += 1
                if tally.first_invalidation_s is None:
                    tally.first_invalidation_s = time.monotonic() - start
                    tally.first_invalidation = str(exc)
                continue
            except CudaError as exc:
                tally.capture_errors[exc.result] += 1
                continue
            tally.captured += 1
            if tally.captured % INSTANTIATE_EVERY == 0:
                drv.graph_exec_destroy(cap.instantiate())
                tally.instantiated += 1
            drv.graph_destroy(cap.graph)
    finally:
        drv.mem_free(buf)


def run(
    mode: str,
    gate_on: bool,
    policy: str,
    threads: int,
    seconds: float,
    hazards: bool,
    blocking: bool,
) -> dict[str, Any]:
    from capsafe import driver
    from capsafe.context import device
    from capsafe.gate import gate

    device(0)
    drv = driver.GatedDriver(driver.raw(), gate() if gate_on else None, policy=policy)
    stream = drv.stream_create(nonblocking=not blocking)
    tally = Tally(allocator_calls=[0] * threads)
    stop = threading.Event()
    ready = threading.Barrier(threads + 1, timeout=60)
    workers = [
        threading.Thread(
            target=allocator,
            name=f"allocator-{i}",
            daemon=True,
            args=(drv, i, tally, stop, stream, hazards, ready),
        )
        for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    ready.wait()
    start = time.monotonic()
    try:
        capture_loop(drv, stream, mode, seconds, tally, start)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
    hung = [w.name for w in workers if w.is_alive()]
    drv.stream_destroy(stream)
    stats = gate().stats()
    return {
        **tally.as_dict(),
        "hung_threads": hung,
        "gate_stats": {
            "shared_entered": stats.shared_entered,
            "contended_waits": stats.contended_waits,
            "capture_waits": stats.capture_waits,
            "max_wait_s": stats.max_wait_s,
        }
        if gate_on
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = reproducer_parser(__doc__, __spec__.name)
    parser.add_argument(
        "--mode",
        choices=("global", "thread_local", "relaxed"),
        default="global",
        help="capture mode of the main thread's captures (default: global)",
    )
    parser.add_argument(
        "--gate",
        choices=("on", "off"),
        default="on",
        help="route driver calls through the capture gate (default: on)",
    )
    parser.add_argument(
        "--policy",
        choices=("conservative", "measured"),
        default="conservative",
        help="gate policy when --gate on",
    )
    parser.add_argument("--threads", type=int, default=4, help="allocator threads (default: 4)")
    parser.add_argument("--seconds", type=float, default=2.0, help="run time (default: 2)")
    parser.add_argument(
        "--hazards",
        action="store_true",
        help="cycle through every capture-breaking call, not only alloc/free",
    )
    parser.add_argument(
        "--blocking-stream",
        action="store_true",
        help="capture on a blocking stream (legacy-stream work then breaks it)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0:
        parser.error("--threads must be >= 1 and --seconds > 0")
    select_backend(args.backend)
    result = run(
        args.mode,
        args.gate == "on",
        args.policy,
        args.threads,
        args.seconds,
        args.hazards,
        args.blocking_stream,
    )
    facts = device_facts()
    first = result["first_invalidation_s"]
    print(f"backend {facts['backend']}, device {facts['device']}, driver {facts['driver_version']}")
    print(
        f"mode {args.mode}, gate {args.gate} ({args.policy}), {args.threads} allocator "
        f"threads{' cycling every hazardous call' if args.hazards else ''}, {args.seconds:g} s"
    )
    print(
        f"captures {result['captures']}, captured {result['captured']}, "
        f"invalidations {result['invalidations']}, first invalidation at "
        f"{'-' if first is None else f'{first:.3f} s'}"
    )
    print(
        f"allocator calls {result['allocator_calls']} "
        f"(per thread {result['allocator_calls_per_thread']}), "
        f"allocator errors {result['allocator_errors']} {result['allocator_errors_by_result']}"
    )
    if result["first_invalidation"]:
        print(f"first invalidation: {result['first_invalidation']}")
    if result["hung_threads"]:
        print(f"allocator threads still running after 30 s: {result['hung_threads']}")
    ok = not result["hung_threads"]
    if args.gate == "on":
        ok = ok and result["invalidations"] == 0 and result["allocator_errors"] == 0
    settings = {
        "mode": args.mode,
        "gate": args.gate,
        "policy": args.policy,
        "threads": args.threads,
        "seconds": args.seconds,
        "hazards": args.hazards,
        "blocking_stream": args.blocking_stream,
    }
    return finish({**facts, **settings, **result}, args.json, ok)


if __name__ == "__main__":
    sys.exit(run_main(main, "capsafe_repro.capture_race"))
