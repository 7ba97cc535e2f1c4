import time

import capsafe
from capsafe import driver
from capsafe.handles import CaptureMode

# Long enough that a neighbour thread's synchronizing call lands inside the window.
WINDOW_S = 0.05
N = 1 << 16


def test_a_leaves_capture_open():
    # As a graph test whose capture a neighbour breaks: the work recorded after the break
    # raises, so the test never reaches end_capture and its stream stays capturing (left
    # open, invalidated) for the rest of the process. Alone, the capture ends and all is freed.
    capsafe.device(0)
    drv = driver.get(gated=False)
    ptr = drv.mem_alloc(N)
    stream = drv.stream_create(nonblocking=True)
    drv.stream_begin_capture(stream, CaptureMode.GLOBAL)
    time.sleep(WINDOW_S)
    drv.memset_d8_async(ptr, 1, N, stream)  # CaptureInvalidated once a neighbour broke it
    drv.graph_destroy(drv.stream_end_capture(stream))
    drv.stream_destroy(stream)
    drv.mem_free(ptr)


def test_b_allocates():
    # Never captures. After test_a left its GLOBAL capture open in this process, cuMemAlloc
    # fails CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (measured on the H200, 2026-12-01).
    capsafe.device(0)
    drv = driver.get(gated=False)
    drv.mem_free(drv.mem_alloc(N))


def test_c_computes():
    # Touches no device: the control, which passes whatever ran before it.
    assert sum(range(10)) == 45
