"""What the capture gate costs, measured side by side in one run; the summary is the last line.

1. Uncontended: one shared section (enter + exit) against a bare threading.Lock
   acquire + release, in the same loop shape (target: at most 3x).
2. On a GPU: a gated cuMemAlloc + cuMemFree pair against the same pair on the
   raw backend (target: at most 1.10x); skipped without a GPU.
3. Under contention: a capture loop on the main thread against allocator
   threads, gate on: captures per second, and every allocator thread's calls
   (no thread may starve: the minimum must be above 0).

Run: PYTHONPATH=$PWD python3 benchmarks/gate.py [--seconds S] [--threads N]
(CAPSAFE_BACKEND=cuda|sim picks the backend for part 3; default auto.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capsafe.backend import Backend
    from capsafe.driver import GatedDriver


def interleaved_ratio(
    loop_a: Callable[[int], None], loop_b: Callable[[int], None], n: int, rounds: int = 15
) -> tuple[float, float, float]:
    """(a, b seconds per op, median a/b ratio), the two loops alternating round by round.

    Driver calls drift over seconds (allocator state, clocks); measuring A's
    rounds and then B's would fold that drift into the ratio.
    """
    times_a: list[float] = []
    times_b: list[float] = []
    ratios: list[float] = []
    for i in range(rounds):
        order = ((loop_a, times_a), (loop_b, times_b))
        for loop, times in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            loop(n)
            times.append((time.perf_counter() - start) / n)
        ratios.append(times_a[-1] / times_b[-1])
    return statistics.median(times_a), statistics.median(times_b), statistics.median(ratios)


def uncontended(n: int = 200_000) -> dict[str, float]:
    from capsafe.gate import CaptureGate

    gate, lock = CaptureGate(), threading.Lock()

    def gate_calls(k: int) -> None:
        enter, exit_ = gate.enter, gate.exit
        for _ in range(k):
            enter()
            exit_()

    def lock_calls(k: int) -> None:
        acquire, release = lock.acquire, lock.release
        for _ in range(k):
            acquire()
            release()

    def gate_with(k: int) -> None:
        for _ in range(k):
            with gate:
                pass

    def lock_with(k: int) -> None:
        for _ in range(k):
            with lock:
                pass

    out = {}
    for name, gated, bare in (("calls", gate_calls, lock_calls), ("with", gate_with, lock_with)):
        g, b, ratio = interleaved_ratio(gated, bare, n)
        out[f"gate_{name}_ns"], out[f"lock_{name}_ns"], out[f"ratio_{name}"] = (
            g * 1e9,
            b * 1e9,
            ratio,
        )
    return out


def gpu_alloc_free(n: int = 500, size: int = 1 << 20) -> dict[str, float | str] | str:
    """Gated vs raw cuMemAlloc+cuMemFree on device 0, or why it was skipped."""
    from capsafe import backend_cuda
    from capsafe.driver import GatedDriver
    from capsafe.gate import CaptureGate

    reason = backend_cuda.unavailable_reason()
    if reason is not None:
        return f"skipped: no GPU ({reason})"
    raw = backend_cuda.CudaBackend()
    raw.init()
    device = raw.device_get(0)
    raw.ctx_set_current(raw.primary_ctx_retain(device))
    gated = GatedDriver(raw, CaptureGate())

    def pairs(drv: Backend | GatedDriver) -> Callable[[int], None]:
        def loop(k: int) -> None:
            alloc, free = drv.mem_alloc, drv.mem_free
            for _ in range(k):
                free(alloc(size))

        return loop

    pairs(raw)(100)  # warm the allocator
    g, r, ratio = interleaved_ratio(pairs(gated), pairs(raw), n)
    return {
        "gated_us": g * 1e6,
        "raw_us": r * 1e6,
        "ratio": ratio,
        "device": raw.device_get_name(device),
    }


def contention(seconds: float, threads: int) -> dict[str, Any]:
    from capsafe_repro.capture_race import run

    result = run("global", True, "conservative", threads, seconds, False, False)
    result["captures_per_s"] = result["captures"] / seconds
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="contention run (default 2)")
    parser.add_argument("--threads", type=int, default=4, help="allocator threads (default 4)")
    args = parser.parse_args(argv)

    from capsafe import driver

    u = uncontended()
    print(
        f"uncontended shared enter+exit: {u['gate_calls_ns']:.0f} ns vs Lock acquire+release "
        f"{u['lock_calls_ns']:.0f} ns = {u['ratio_calls']:.2f}x; with-statement "
        f"{u['gate_with_ns']:.0f} ns vs {u['lock_with_ns']:.0f} ns = {u['ratio_with']:.2f}x"
    )
    gpu = gpu_alloc_free()
    if isinstance(gpu, str):
        gpu_text = gpu
    else:
        gpu_text = (
            f"{gpu['gated_us']:.2f} us vs {gpu['raw_us']:.2f} us = {gpu['ratio']:.3f}x "
            f"on {gpu['device']}"
        )
    print(f"cuMemAlloc+cuMemFree gated vs raw: {gpu_text}")
    c = contention(args.seconds, args.threads)
    per_thread = c["allocator_calls_per_thread"]
    print(
        f"contention ({driver.backend_choice()}, {args.threads} allocator threads, "
        f"{args.seconds:g} s, gate on): {c['captures']} captures ({c['captures_per_s']:.0f}/s), "
        f"{c['invalidations']} invalidated, allocator calls per thread {per_thread}"
    )
    starving = min(per_thread) == 0
    gpu_ratio = gpu_text if isinstance(gpu, str) else f"{gpu['ratio']:.3f}x (target <= 1.10x)"
    print(
        f"SUMMARY gate: shared section {u['ratio_calls']:.2f}x a Lock round-trip "
        f"(with: {u['ratio_with']:.2f}x; target <= 3x); alloc+free gated/raw {gpu_ratio}; "
        f"{c['captures_per_s']:.0f} captures/s, {c['invalidations']} invalidated, min allocator "
        f"progress {min(per_thread)} calls ({'STARVED' if starving else 'no starvation'})"
    )
    return 1 if starving or c["invalidations"] else 0


if __name__ == "__main__":
    sys.exit(main())
