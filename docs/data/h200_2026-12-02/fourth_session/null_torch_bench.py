"""capsafe.integrations.torch's own Python cost per capture, over a torch whose calls do nothing."""
import sys, types, time, statistics, cProfile, pstats, io, contextlib
torch = types.ModuleType("torch"); cuda = types.ModuleType("torch.cuda"); C = types.ModuleType("torch._C")
memory = types.ModuleType("torch.cuda.memory")
torch.cuda = cuda; torch._C = C; cuda.memory = memory
class _CUDAGraph:
    def capture_begin(self, pool=None, capture_error_mode="global"): pass
    def capture_end(self): pass
    def replay(self): pass
class CUDAGraph(_CUDAGraph):
    def capture_begin(self, pool=None, capture_error_mode="global"):
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)
    def capture_end(self):
        super().capture_end()
class Stream:
    def synchronize(self): pass
class Event:
    def synchronize(self): pass
def synchronize(device=None): pass
def empty_cache(): pass
def _host_emptyCache(): pass
def is_current_stream_capturing(): return False
def current_stream(device=None): return Stream()
cuda.CUDAGraph = CUDAGraph; cuda.Stream = Stream; cuda.Event = Event; cuda.synchronize = synchronize
cuda.empty_cache = empty_cache; memory.empty_cache = empty_cache; C._host_emptyCache = _host_emptyCache
cuda.is_current_stream_capturing = is_current_stream_capturing; cuda.current_stream = current_stream
class graph:
    def __init__(self, g, stream=None, capture_error_mode="global"):
        self.g, self.mode = g, capture_error_mode
    def __enter__(self):
        torch.cuda.synchronize(); torch.cuda.empty_cache(); torch._C._host_emptyCache()
        self.g.capture_begin(None, capture_error_mode=self.mode)
    def __exit__(self, *exc):
        self.g.capture_end()
cuda.graph = graph
sys.modules.update({"torch": torch, "torch.cuda": cuda, "torch._C": C, "torch.cuda.memory": memory})
from capsafe import driver, context
from capsafe.integrations import torch as integ
print("backend", driver.backend_choice(), "policy", driver.get().policy)
mode = sys.argv[1] if len(sys.argv) > 1 else "global"
def loop(k):
    for _ in range(k):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode=mode):
            pass
def per(k=5000):
    t = time.perf_counter(); loop(k); return (time.perf_counter() - t) / k * 1e6
res = {"plain": [], "capsafe": []}
for r in range(9):
    res["plain"].append(per())
    with integ.installed():
        res["capsafe"].append(per())
p, c = statistics.median(res["plain"]), statistics.median(res["capsafe"])
print(f"{mode}: plain {p:.2f} us, capsafe {c:.2f} us per capture: capsafe adds {c - p:.2f} us")
if "--profile" in sys.argv:
    with integ.installed():
        pr = cProfile.Profile(); pr.enable(); loop(3000); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40); print(s.getvalue()[:7000])
