"""Where the protected torch loop's extra time lands: each part of an iteration timed, plain vs variants."""
import sys, time, random, statistics, gc
sys.path.insert(0, "benchmarks")
import torch
from capsafe import context, driver
from capsafe.integrations import torch as integ
from capsafe.integrations._patch import defining_class
context.device(0)
mode = sys.argv[1] if len(sys.argv) > 1 else "global"
x = torch.ones(1 << 16, device="cuda"); out = torch.empty_like(x); stream = torch.cuda.Stream()
pc = time.perf_counter
def loop(k, acc):
    for _ in range(k):
        t0 = pc(); g = torch.cuda.CUDAGraph(); cm = torch.cuda.graph(g, stream=stream, capture_error_mode=mode)
        t1 = pc(); cm.__enter__()
        t2 = pc(); out.copy_(x * 2 + 1)
        t3 = pc(); cm.__exit__(None, None, None)
        t4 = pc()
        for _ in range(10): g.replay()
        t5 = pc()
        acc[0] += t1 - t0; acc[1] += t2 - t1; acc[2] += t3 - t2; acc[3] += t4 - t3; acc[4] += t5 - t4
    t6 = pc(); torch.cuda.synchronize(); acc[5] += pc() - t6
def full():
    integ.install(); return integ.uninstall
def ungated():
    integ.install(driver.get().backend); return integ.uninstall
def windows_only():
    integ.install()
    saved = integ._installer.current.patches._saved
    for owner, name, orig in list(saved):
        if name not in ("capture_begin", "capture_end", "capture_end_pre"):
            setattr(owner, name, orig)
    return integ.uninstall
def sync_only():
    integ.install()
    saved = integ._installer.current.patches._saved
    for owner, name, orig in list(saved):
        if name in ("capture_begin", "capture_end", "capture_end_pre"):
            setattr(owner, name, orig)
    integ.windows.hooked = True
    return integ.uninstall
variants = {"plain": lambda: (lambda: None), "capsafe": full, "ungated": ungated,
            "windows_only": windows_only, "sync_only": sync_only}
names = ["new", "enter", "copy", "exit", "replays", "final_sync"]
res = {n: [] for n in variants}
acc0 = [0.0] * 6
loop(30, acc0)
for r in range(15):
    order = list(variants); random.shuffle(order)
    for n in order:
        undo = variants[n]()
        try:
            loop(3, [0.0] * 6)
            acc = [0.0] * 6; k = 150; t = pc(); loop(k, acc); total = pc() - t
            res[n].append([total / k * 1e6] + [a / k * 1e6 for a in acc])
        except Exception as e:
            print("variant", n, "failed:", repr(e)); res[n].append([float("nan")] * 7)
        finally:
            undo()
print(f"{mode}: us per iteration, medians over 15 rounds")
print(f"{'variant':14s} {'total':>8s} " + " ".join(f"{n:>10s}" for n in names))
for n, rows in res.items():
    cols = list(zip(*rows))
    print(f"{n:14s} " + " ".join(f"{statistics.median(c):8.1f}  " for c in cols))
