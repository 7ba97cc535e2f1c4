import sys
sys.path.insert(0, "/work/wt-torchwin/benchmarks")
import null_torch, torch_protect
torch = null_torch.install()
from capsafe.integrations import torch as integ
from capsafe import driver
driver.get()
which, k = sys.argv[1], int(sys.argv[2])
loop = torch_protect.null_loop(torch, "global")
if which == "protected":
    integ.install()
loop(50)
loop(k)
