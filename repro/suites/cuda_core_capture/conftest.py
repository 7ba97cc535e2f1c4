import os
import sys

# The simulated device unless the sweep asks for the real one (CAPSAFE_BACKEND=cuda on a GPU).
# On the simulated device cuda.core cannot run, so a small fake of the parts these tests
# use stands in for it, over the same simulated driver the neighbour threads call.
os.environ.setdefault("CAPSAFE_BACKEND", "sim")
if os.environ["CAPSAFE_BACKEND"] == "sim":
    sys.path.insert(0, os.path.dirname(__file__))
    from capsafe import driver
    from fake_cuda_core import fake_cuda_core

    core, graph = fake_cuda_core(driver.raw())
    sys.modules["cuda.core"], sys.modules["cuda.core.graph"] = core, graph
