import sys, collections
sys.argv=['x']
import null_torch, torch_protect
torch = null_torch.install()
from capsafe.integrations import torch as integ
loop = torch_protect.null_loop(torch, sys.argv[1] if len(sys.argv)>1 else "global")
def count(k):
    c = collections.Counter()
    def prof(frame, event, arg):
        if event == "call":
            c[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
    sys.setprofile(prof); loop(k); sys.setprofile(None)
    return c
plain = count(100)
with integ.installed():
    loop(10)
    prot = count(100)
diff = prot - plain
for k, v in sorted(diff.items(), key=lambda kv: -kv[1]): print(f"{v/100:5.1f} {k}")
print("total", sum(diff.values())/100)
