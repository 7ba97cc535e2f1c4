import capsafe
from capsafe import driver
from capsafe.handles import CaptureMode
from capsafe_repro.window import hold_open  # the window spans the neighbours' calls


def test_raw_global_capture():
    # Ungated: a GLOBAL capture while other threads allocate and synchronize is invalidated.
    capsafe.device(0)
    drv = driver.get(gated=False)
    stream = drv.stream_create(nonblocking=True)
    try:
        drv.stream_begin_capture(stream, CaptureMode.GLOBAL)
        hold_open()
        drv.graph_destroy(drv.stream_end_capture(stream))
    finally:
        drv.stream_destroy(stream)


def test_protected_capture():
    # Through capsafe.capture the neighbours wait at the gate, so the capture survives.
    capsafe.device(0)
    drv = driver.get()
    stream = drv.stream_create(nonblocking=True)
    try:
        with capsafe.capture(stream, CaptureMode.GLOBAL) as cap:
            hold_open()
        drv.graph_destroy(cap.graph)
    finally:
        drv.stream_destroy(stream)
