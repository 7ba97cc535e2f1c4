"""Three cuda.core graph captures, each with an allocation made before it and one inside it."""

import contextlib

from cuda.core import Device, GraphMemoryResource

from capsafe.integrations import cuda_core as integration
from capsafe_repro.window import hold_open  # the window spans the neighbours' calls

N = 1 << 16


def three_captures(capture):
    device = Device(0)
    device.set_current()
    stream = device.create_stream()
    for _ in range(3):
        outside = device.allocate(N, stream=stream)
        builder = device.create_graph_builder()
        with capture(builder):
            # A graph allocation, captured (cuda.core 1.2 refuses the device's pool here).
            inside = GraphMemoryResource(device).allocate(N, stream=builder)
            hold_open()  # the neighbours' calls land here; the fill then reports it
            inside.fill(7, stream=builder)
            inside.close(builder)
        graph = builder.complete()
        graph.launch(stream)
        stream.sync()
        outside.close(stream)
        builder.close()


@contextlib.contextmanager
def cuda_core_building(builder):
    # cuda.core's own API, as existing code calls it (relaxed mode, cuda.core's default).
    builder.begin_building()
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            builder.close()  # ends the broken capture, so the test leaves nothing capturing
        raise
    builder.end_building()


def test_three_captures():
    three_captures(cuda_core_building)


def test_three_captures_through_capsafe():
    # capsafe's helper holds the capture gate whether or not --capsafe-protect is given.
    three_captures(integration.capture)
