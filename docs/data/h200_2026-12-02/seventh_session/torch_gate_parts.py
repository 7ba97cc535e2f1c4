"""Which part of the gate's begin/release costs a protected torch capture, in situ (H200).

Variants alternate in a shuffled order each round; each is reported as the median of
its per-round ratio to the plain loop of the same round."""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from typing import Any

import torch

from capsafe import context, driver
from capsafe._diagnostics import outer_site
from capsafe.gate import CaptureGuard
from capsafe.integrations import torch as integ
from capsafe.integrations._capture_windows import gate_of
from capsafe.integrations._patch import defining_class

ELEMENTS, REPLAYS, N = 1 << 16, 10, 200
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
context.device(0)
G = torch.cuda.CUDAGraph
B_OWNER = defining_class(G, "capture_begin")
E_OWNER = defining_class(G, "capture_end")
BEGIN = B_OWNER.__dict__["capture_begin"]
END = E_OWNER.__dict__["capture_end"]
gate = gate_of(driver.get())

# clock and frame costs in a tight loop
for name, fn in (("time.monotonic", time.monotonic), ("perf_counter_ns", time.perf_counter_ns),
                 ("threading.get_ident", threading.get_ident)):
    t0 = time.perf_counter()
    for _ in range(100000):
        fn()
    print(f"tight {name}: {(time.perf_counter() - t0) * 10:.3f} us/call")
import subprocess
print(subprocess.run(["cat", "/sys/devices/system/clocksource/clocksource0/current_clocksource"],
                     capture_output=True, text=True).stdout.strip())


def make_loop(mode: str):
    x = torch.ones(ELEMENTS, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()

    def loop(k: int) -> None:
        for _ in range(k):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream, capture_error_mode=mode):
                out.copy_(x * 2 + 1)
            for _ in range(REPLAYS):
                g.replay()
        torch.cuda.synchronize()

    return loop


class Swap:
    def __init__(self, begin: Any = None, end: Any = None) -> None:
        self.begin, self.end = begin, end

    def __enter__(self) -> None:
        if self.begin:
            B_OWNER.capture_begin = self.begin
        if self.end:
            E_OWNER.capture_end = self.end

    def __exit__(self, *a: Any) -> None:
        B_OWNER.capture_begin = BEGIN
        E_OWNER.capture_end = END


def hooks(before, after):
    def b(g, *a, **k):
        before(g)
        return BEGIN(g, *a, **k)

    def e(g):
        r = END(g)
        after(g)
        return r

    return Swap(b, e)


held: dict[int, Any] = {}
nothing = lambda g: None  # noqa: E731


def v_gate():
    def bf(g):
        held[id(g)] = gate.begin_capture(harmful=None, label="x", timeout=60.0)
    return hooks(bf, lambda g: held.pop(id(g)).release())


def v_gate_raw():
    def bf(g):
        made: list = []
        gate._begin(gate._tls.rec, None, "x", None, 60.0, made)
        held[id(g)] = made[0]
    return hooks(bf, lambda g: gate._release(held.pop(id(g))))


def v_guard():
    rec = gate._tls.rec
    return hooks(lambda g: held.__setitem__(id(g), CaptureGuard(gate, rec, None, "x", None)),
                 lambda g: held.pop(id(g)))


def v_lock():
    lock = gate._lock

    def bf(g):
        with lock:
            pass
    return hooks(bf, bf)


def v_site():
    return hooks(lambda g: outer_site(sys._getframe(0)), nothing)


def v_mono():
    return hooks(lambda g: time.monotonic(), nothing)


def v_getframe():
    return hooks(lambda g: sys._getframe(1), nothing)


class Null:
    def __enter__(self):
        pass

    def __exit__(self, *a):
        pass


VARIANTS = {
    "plain": Null,
    "hooks_nothing": lambda: hooks(nothing, nothing),
    "mono": v_mono,
    "getframe": v_getframe,
    "site": v_site,
    "lock": v_lock,
    "guard_obj": v_guard,
    "gate_raw": v_gate_raw,
    "gate": v_gate,
    "full": integ.installed,
}

# make sure the thread has a gate record
with gate:
    pass

for mode in ("global",):
    loop = make_loop(mode)
    for mk in VARIANTS.values():
        with mk():
            loop(20)
    per: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratio: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rng = random.Random(7)
    for r in range(ROUNDS):
        names = list(VARIANTS)
        rng.shuffle(names)
        this = {}
        for name in names:
            with VARIANTS[name]():
                t0 = time.perf_counter()
                loop(N)
                this[name] = (time.perf_counter() - t0) / N * 1e6
        for name in names:
            per[name].append(this[name])
            ratio[name].append(this[name] / this["plain"])
    print(f"== {mode}: median us/iter, median per-round ratio to plain [q1, q3]")
    for name in VARIANTS:
        q = statistics.quantiles(ratio[name], n=4)
        print(f"  {name:14s} {statistics.median(per[name]):7.1f}  {statistics.median(ratio[name]):.3f}x"
              f"  [{q[0]:.3f}, {q[2]:.3f}]")
