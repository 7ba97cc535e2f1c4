import sys, collections
sys.path.insert(0, "/work/wt-torchwin/benchmarks")
import null_torch, torch_protect
torch = null_torch.install()
from capsafe.integrations import torch as integ
loop = torch_protect.null_loop(torch, "global")
def count(k):
    c = collections.Counter()
    def local(frame, event, arg):
        if event == "opcode":
            c[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
        return local
    def glob(frame, event, arg):
        frame.f_trace_opcodes = True
        return local
    sys._getframe().f_trace_opcodes = True
    sys.settrace(glob); loop(k); sys.settrace(None)
    return c
plain = count(10)
with integ.installed():
    loop(5)
    prot = count(10)
diff = prot - plain
for k, v in sorted(diff.items(), key=lambda kv: -kv[1]): print(f"{v/10:6.1f} {k}")
print("total opcodes added per capture", sum(diff.values())/10)
