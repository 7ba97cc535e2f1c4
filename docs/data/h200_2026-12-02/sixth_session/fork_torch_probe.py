"""Which order of CUDA initialisation crashes torch in a child forked from a torch-importing parent."""
import os, sys, threading, time
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = sys.argv[1] if len(sys.argv) > 1 else "1"
import torch
print("parent is_available", torch.cuda.is_available(), "initialized", torch.cuda.is_initialized(), flush=True)
from cuda.bindings import driver as drv

def bindings_init(thread=False):
    def f():
        err, = drv.cuInit(0)
        err2, dev = drv.cuDeviceGet(0)
        err3, ctx = drv.cuDevicePrimaryCtxRetain(dev)
        drv.cuCtxSetCurrent(ctx)
    if thread:
        t = threading.Thread(target=f); t.start(); t.join()
    else:
        f()

def torch_work():
    x = torch.ones(4, device="cuda"); torch.cuda.synchronize(); return float(x.sum())

VARIANTS = {
    "torch_only": lambda: torch_work(),
    "cuinit_main_then_torch": lambda: (bindings_init(False), torch_work()),
    "cuinit_thread_then_torch": lambda: (bindings_init(True), torch_work()),
    "torch_init_then_cuinit_thread_then_torch": lambda: (torch.cuda.init(), bindings_init(True), torch_work()),
    "unset_env_cuinit_then_torch": lambda: (os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None), bindings_init(True), torch_work()),
    "cuinit_only_then_torch_init": lambda: (drv.cuInit(0), torch_work()),
}
for name, fn in VARIANTS.items():
    pid = os.fork()
    if pid == 0:
        try:
            r = fn()
            print(f"  {name}: ok {r}", flush=True)
            os._exit(0)
        except BaseException as e:
            print(f"  {name}: raised {type(e).__name__}: {e}", flush=True)
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    print(f"{name}: exit {os.waitstatus_to_exitcode(status)} signal {sig}", flush=True)
