import capsafe
from capsafe import driver
from capsafe.handles import CaptureMode
from capsafe_repro.window import hold_open  # the window spans the neighbours' calls


def test_raw_relaxed_capture():
    # As CuPy captures: RELAXED mode on a blocking stream, ungated. Other threads' allocations
    # do not break it; their device synchronization and legacy-stream work do.
    capsafe.device(0)
    drv = driver.get(gated=False)
    stream = drv.stream_create(nonblocking=False)
    try:
        drv.stream_begin_capture(stream, CaptureMode.RELAXED)
        hold_open()
        drv.graph_destroy(drv.stream_end_capture(stream))
    finally:
        drv.stream_destroy(stream)
