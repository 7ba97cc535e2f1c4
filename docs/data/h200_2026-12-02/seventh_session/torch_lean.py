"""The floor a leaner protection could reach, in situ (H200): the same gate protocol with
the free path inline (prototype, probe only), against the integration as it stands."""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from capsafe import context, driver
from capsafe.gate import CaptureGuard
from capsafe.integrations import torch as integ
from capsafe.integrations._capture_windows import gate_of
from capsafe.integrations._patch import defining_class

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
from torch_protect import capture_and_replay

N = 200
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
context.device(0)
G = torch.cuda.CUDAGraph
B_OWNER = defining_class(G, "capture_begin")
E_OWNER = defining_class(G, "capture_end")
BEGIN = B_OWNER.__dict__["capture_begin"]
END = E_OWNER.__dict__["capture_end"]
gate = gate_of(driver.get())
with gate:
    pass
tls, lock = gate._tls, gate._lock
SYNC = [(torch.cuda, "synchronize", "ctx_sync"), (torch.cuda, "empty_cache", "mem_free"),
        (torch._C, "_host_emptyCache", "host_free")]


def make_loop(mode: str):
    """benchmarks/torch_protect.py's loop, the one the target is measured on."""
    return capture_and_replay(torch, mode)


open_: dict[Any, Any] = {}
new = object.__new__
monotonic = time.monotonic


def lean_begin(graph, *args, **kwargs):
    rec = tls.rec
    with lock:
        free = gate._owner is None and not rec.waiting
        if free:
            for other in gate._records:
                if other is not rec and (other.granted or (other.depth and not other.aside)):
                    free = False
                    break
        if free:
            guard = new(CaptureGuard)
            guard._gate = gate
            guard._generation = gate._generation
            guard._released = False
            guard.record = rec
            guard.harmful = None
            guard.label = graph
            guard._site = None
            guard.started = monotonic()
            rec.aside = True
            gate._closed = True
            gate._owner = rec
            gate._window += 1
            gate._harmful = None
            gate._guards = [guard]
            gate._captures += 1
    if not free:
        guard = gate.begin_capture(label="slow")
    open_[graph] = guard
    return BEGIN(graph, *args, **kwargs)


def lean_end(graph):
    r = END(graph)
    gate._release(open_.pop(graph))
    return r


def lean_section(fn):
    def section(*args, **kwargs):
        rec = tls.rec
        depth = rec.depth
        if depth == 0:
            rec.depth = 1
            rec.entered += 1
            if gate._closed:
                rec.depth = 0
                rec.entered -= 1
                gate.enter(None)
        else:
            gate.enter(None)
        try:
            return fn(*args, **kwargs)
        finally:
            if rec.depth == 1 and not gate._closed:
                rec.depth = 0
            else:
                gate.exit()
    return section


class Patch:
    def __init__(self, hooks: bool, sections: bool) -> None:
        self.hooks, self.sections, self.saved = hooks, sections, []

    def __enter__(self):
        if self.hooks:
            B_OWNER.capture_begin = lean_begin
            E_OWNER.capture_end = lean_end
        if self.sections:
            for mod, name, _ in SYNC:
                fn = getattr(mod, name)
                self.saved.append((mod, name, fn))
                setattr(mod, name, lean_section(fn))

    def __exit__(self, *a):
        B_OWNER.capture_begin = BEGIN
        E_OWNER.capture_end = END
        while self.saved:
            mod, name, fn = self.saved.pop()
            setattr(mod, name, fn)


class GateSections(Patch):
    def __enter__(self):
        super().__enter__()
        for mod, name, call in SYNC:
            fn = getattr(mod, name)
            self.saved.append((mod, name, fn))
            setattr(mod, name, gate.wrap(fn, call))


class Null:
    def __enter__(self):
        pass

    def __exit__(self, *a):
        pass


VARIANTS = {
    "plain": Null,
    "lean_hooks": lambda: Patch(True, False),
    "lean_sections": lambda: Patch(False, True),
    "lean_all": lambda: Patch(True, True),
    "lean_hooks+gate_sections": lambda: GateSections(True, False),
    "gate_sections": lambda: GateSections(False, False),
    "full": integ.installed,
}

for mode in ("global", "relaxed"):
    loop = make_loop(mode)
    for mk in VARIANTS.values():
        with mk():
            loop(20)
            assert not open_ and gate._owner is None
    per: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratio: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rng = random.Random(11)
    for _r in range(ROUNDS):
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
        med = statistics.median(ratio[name])
        print(f"  {name:26s} {statistics.median(per[name]):7.1f}  {med:.3f}x"
              f"  [{q[0]:.3f}, {q[2]:.3f}]")
print("captures", gate._captures)
