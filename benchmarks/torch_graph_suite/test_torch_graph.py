"""torch.cuda.graph captures in each of the three capture modes, as a PyTorch suite writes them.

For `capsafe sweep` on a GPU (issue 20's done-when): beside `--neighbors` threads each
capture may be broken (capture-unsafe, with its capture site); without them each passes;
with `--capsafe-protect=torch` each survives the neighbours. Skipped without torch or CUDA.
"""

import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

N = 1 << 16
WORK_S = 0.02  # host time inside the window, so a neighbour's call lands there


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_and_replay(mode):
    x = torch.zeros(N, device="cuda")
    y = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up the kernels outside the capture
        y.copy_(x * 2 + 1)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, capture_error_mode=mode):
        y.copy_(x * 2 + 1)
        time.sleep(WORK_S)
        y.add_(1)
    for value in (1.0, 3.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(x, value * 2 + 2))
