import time
from contextlib import contextmanager

import capsafe
from capsafe import driver
from capsafe.errors import CudaError
from capsafe.handles import CaptureMode

# Long enough that a neighbour thread's synchronizing call lands inside the window.
WINDOW_S = 0.05
N = 1 << 16


class LibraryError(RuntimeError):
    """A CUDA library's own status (as cuRAND or cuBLAS raise it): no capture error by
    type, and no capture error's name or description in its text."""


@contextmanager
def graph_capture(drv, stream):
    # As `with torch.cuda.graph(g):`: the exit ends the capture even when the body raised,
    # and the body's error, not the end's, is what the caller sees.
    drv.stream_begin_capture(stream, CaptureMode.GLOBAL)
    try:
        yield
    finally:
        try:
            drv.graph_destroy(drv.stream_end_capture(stream))
        except CudaError:
            pass


def _launch(drv, ptr, stream):
    """The library's kernel launch, reporting a status as libraries do."""
    try:
        drv.memset_d8_async(ptr, 1, N, stream)
    except CudaError:
        return "CURAND_STATUS_LAUNCH_FAILURE"
    return "CURAND_STATUS_SUCCESS"


def test_library_call_in_capture():
    capsafe.device(0)
    drv = driver.get(gated=False)
    ptr = drv.mem_alloc(N)
    stream = drv.stream_create(nonblocking=True)
    try:
        with graph_capture(drv, stream):
            time.sleep(WINDOW_S)
            status = _launch(drv, ptr, stream)
            if status != "CURAND_STATUS_SUCCESS":
                raise LibraryError(status)
    finally:
        drv.stream_destroy(stream)
        drv.mem_free(ptr)


def test_computes():
    # Touches no device: the control.
    assert sum(range(10)) == 45
