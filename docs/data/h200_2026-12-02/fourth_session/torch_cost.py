"""Where capsafe.integrations.torch's cost goes: per-variant wall per iteration (interleaved,
installed outside the timing), install/uninstall cost, and a cProfile of the protected loop."""
import sys, time, functools, random, statistics, cProfile, pstats, io
sys.path.insert(0, "benchmarks")
import torch
from torch_protect import capture_and_replay
from capsafe import context, driver
from capsafe.integrations import torch as integ
from capsafe.integrations._patch import defining_class
context.device(0)
mode = sys.argv[1] if len(sys.argv) > 1 else "global"
loop = capture_and_replay(torch, mode)
loop(50)
def measure(k=200):
    w = time.perf_counter(); loop(k)
    return (time.perf_counter() - w) / k * 1e6
def null_capture():
    cls = torch.cuda.CUDAGraph; saved = []
    for name in ("capture_begin", "capture_end"):
        owner = defining_class(cls, name)
        f = owner.__dict__[name]; saved.append((owner, name, f))
        def w(self, *a, _f=f, **k): return _f(self, *a, **k)
        setattr(owner, name, w)
    return lambda: [setattr(o, n, f) for o, n, f in reversed(saved)]
def null_sync():
    saved = []
    for path, fname, call in integ.FUNCTIONS:
        m = integ._module(torch, path)
        if m is not None and fname in vars(m):
            f = vars(m)[fname]; saved.append((m, fname, f))
            def w(*a, _f=f, **k): return _f(*a, **k)
            setattr(m, fname, w)
    for cls_name, name, call in integ.METHODS:
        owner = defining_class(getattr(torch.cuda, cls_name), name)
        f = owner.__dict__[name]; saved.append((owner, name, f))
        def w(self, *a, _f=f, **k): return _f(self, *a, **k)
        setattr(owner, name, w)
    return lambda: [setattr(o, n, f) for o, n, f in reversed(saved)]
def full():
    integ.install(); return integ.uninstall
def capsafe_capture_only():
    integ.install()
    inst = integ._installer._installation if hasattr(integ._installer, "_installation") else None
    # put the sync functions back (keep the capture hooks)
    for path, fname, call in integ.FUNCTIONS:
        m = integ._module(torch, path)
        if m is not None and fname in vars(m) and hasattr(vars(m)[fname], "__wrapped__"):
            setattr(m, fname, vars(m)[fname].__wrapped__)
    return integ.uninstall
import gc
def gc_off(make):
    def v():
        undo = make(); gc.disable()
        return lambda: (gc.enable(), undo())
    return v
variants = {"plain": lambda: (lambda: None), "null_capture": null_capture, "null_sync": null_sync,
            "capsafe": full, "plain_nogc": gc_off(lambda: (lambda: None)), "capsafe_nogc": gc_off(full)}
res = {n: [] for n in variants}
for r in range(21):
    names = list(variants); random.shuffle(names)
    for n in names:
        undo = variants[n]()
        try:
            loop(5); res[n].append(measure())
        finally:
            undo()
base = statistics.median(res["plain"])
for n, xs in res.items():
    w = statistics.median(xs)
    print(f"{mode} {n:14s} wall {w:7.1f} us/iter ({w/base:.3f}x)  iqr {statistics.quantiles(xs, n=4)[0]:.1f}-{statistics.quantiles(xs, n=4)[2]:.1f}")
t = time.perf_counter()
for _ in range(20):
    integ.install(); integ.uninstall()
print(f"install+uninstall {(time.perf_counter()-t)/20*1e6:.0f} us")
integ.install()
loop(20)
pr = cProfile.Profile(); pr.enable(); loop(300); pr.disable()
integ.uninstall()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:6000])
pr = cProfile.Profile(); pr.enable(); loop(300); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15); print("PLAIN", s.getvalue()[:3000])
print("policy", driver.get().policy)
