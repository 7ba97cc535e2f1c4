"""Python calls and ns per protected capture over a torch whose calls do nothing (CPU only).

Run as `python probe.py MODE` with PYTHONPATH=<a capsafe checkout>:<this directory>; it
prints one line: the checkout, the Python and C calls capsafe adds per capture (counted by
sys.setprofile over 100 captures, protected minus plain), the bytecodes it adds (sys.settrace
opcode events, likewise) and the median ns per capture of
15 alternating rounds of 5,000 plain and 5,000 protected captures. `compare.sh` runs it
for two checkouts, alternating, in one run.
"""

import collections
import statistics
import sys
import time

import null_torch  # noqa: F401  (installs the null torch into sys.modules)

import capsafe
from capsafe.integrations import torch as integ

torch = sys.modules["torch"]
mode = sys.argv[1] if len(sys.argv) > 1 else "global"


def loop(k):
    for _ in range(k):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode=mode):
            pass


def count(k):
    c = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            c[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            c["C:" + getattr(arg, "__qualname__", str(arg))] += 1

    sys.setprofile(prof)
    loop(k)
    sys.setprofile(None)
    return c


def opcodes(k):
    n = [0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            n[0] += 1
        return trace

    sys.settrace(trace)
    loop(k)
    sys.settrace(None)
    return n[0]


plain = count(100)
ops_plain = opcodes(100)
with integ.installed():
    loop(10)
    prot = count(100)
    ops = (opcodes(100) - ops_plain) / 100
diff = prot - plain
py = sum(v for k, v in diff.items() if not k.startswith("C:")) / 100
cc = sum(v for k, v in diff.items() if k.startswith("C:")) / 100
if "-v" in sys.argv:
    for k, v in sorted(diff.items(), key=lambda kv: -kv[1]):
        print(f"{v / 100:5.1f} {k}")


def per(k=5000):
    t = time.perf_counter_ns()
    loop(k)
    return (time.perf_counter_ns() - t) / k


res = {"plain": [], "capsafe": []}
for _ in range(15):
    res["plain"].append(per())
    with integ.installed():
        res["capsafe"].append(per())
p, c = statistics.median(res["plain"]), statistics.median(res["capsafe"])
where = capsafe.__file__.split("/")[2]
print(
    f"{where:12s} {mode:12s} python calls {py:4.1f}  C calls {cc:4.1f}  bytecodes {ops:5.0f}  "
    f"plain {p:6.0f} ns  protected {c:6.0f} ns  capsafe adds {c - p:6.0f} ns"
)
