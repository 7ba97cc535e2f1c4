import sys, collections
import null_torch  # noqa: F401  (installs the null torch)
from capsafe.integrations import torch as integ
torch = sys.modules["torch"]
def loop(k):
    for _ in range(k):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="global"):
            pass
c = collections.Counter()
def trace(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode":
        c[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
    return trace
with integ.installed():
    loop(5)
    sys.settrace(trace); loop(100); sys.settrace(None)
for k, v in c.most_common(30): print(f"{v/100:6.1f} {k}")
