"""A torch whose calls do nothing, in torch 2.11's shape as far as capsafe.integrations.torch and torch.cuda.graph touch it (from ../h200_2026-12-02/fourth_session/null_torch_bench.py)."""
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
