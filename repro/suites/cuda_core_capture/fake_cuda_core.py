"""A small stand-in for cuda.core over capsafe's simulated driver: the hook points only.

`Device.memory_resource` (a property; default: a stream-ordered resource over
cuMemAllocAsync / cuMemFreeAsync), `Buffer.from_handle` / `close` / `fill`,
`MemoryResource`, and a `GraphBuilder` whose begin/end_building call the driver
directly, as cuda.core does. Used by this suite on the sim backend and by
tests/core/test_integrations_cuda_core.py.
"""

import contextlib
import types

from capsafe.errors import CudaError
from capsafe.handles import LEGACY_STREAM, DevicePtr


def fake_cuda_core(sim):
    """(the `cuda.core` module, the `cuda.core.graph` module), both over driver `sim`."""

    class MemoryResource:
        pass

    def raw_stream(stream):
        stream = getattr(stream, "stream", stream)  # a GraphBuilder orders work on its stream
        return LEGACY_STREAM if stream is None else stream.raw

    class Buffer:
        def __init__(self, ptr, size, mr, stream):
            self.ptr, self.size, self.mr, self.stream = ptr, size, mr, stream

        @property
        def handle(self):
            return self.ptr

        @staticmethod
        def from_handle(ptr, size, mr=None, owner=None, *, stream=None):
            return Buffer(ptr, size, mr, stream)

        def fill(self, value, *, stream):
            sim.memset_d8_async(DevicePtr(self.ptr, size=self.size), value, self.size,
                                raw_stream(stream))

        def close(self, stream=None):
            if self.ptr and self.mr is not None:
                self.mr.deallocate(self.ptr, self.size, stream or self.stream)
            self.ptr = 0

    class CoreStream:
        def __init__(self):
            self.raw = sim.stream_create(nonblocking=True)
            self.handle = self.raw.value

        def sync(self):
            sim.stream_synchronize(self.raw)

    class StreamOrderedResource(MemoryResource):
        is_device_accessible, is_host_accessible, device_id = True, False, 0

        def allocate(self, size, stream=None):
            ptr = sim.mem_alloc_async(size, raw_stream(stream))
            return Buffer.from_handle(ptr.value, size, mr=self, stream=stream)

        def deallocate(self, ptr, size, stream=None):
            sim.mem_free_async(DevicePtr(int(ptr)), raw_stream(stream))

    class GraphMemoryResource(StreamOrderedResource):
        """Graph allocations: only on a capturing stream, as cuda.core 1.2 insists."""

        def __init__(self, device):
            self.device_id = getattr(device, "device_id", device)

        def allocate(self, size, stream=None):
            if sim.stream_is_capturing(raw_stream(stream)) != "active":
                raise RuntimeError(
                    "GraphMemoryResource cannot perform memory operations on a "
                    "non-capturing stream."
                )
            return super().allocate(size, stream)

    class Graph:
        def __init__(self, graph):
            self.exec = sim.graph_instantiate(graph)

        def launch(self, stream):
            sim.graph_launch(self.exec, stream.raw)

    class GraphBuilder:
        def __init__(self, stream):
            self.stream = stream
            self.graph = None
            self.end_error = None

        def begin_building(self, mode="relaxed"):
            sim.stream_begin_capture(self.stream.raw, mode)
            return self

        def end_building(self):
            self.graph = sim.stream_end_capture(self.stream.raw)
            if self.end_error is not None:
                raise self.end_error
            return self

        @property
        def is_building(self):
            return sim.stream_is_capturing(self.stream.raw) == "active"

        def complete(self):
            return Graph(self.graph)

        def close(self):
            if sim.stream_is_capturing(self.stream.raw) != "none":
                with contextlib.suppress(CudaError):
                    sim.stream_end_capture(self.stream.raw)

    class Device:
        _memory_resource = None

        def __init__(self, device_id=0):
            self.device_id = device_id

        def set_current(self):
            sim.ctx_set_current(sim.primary_ctx_retain(sim.device_get(self.device_id)))

        @property
        def memory_resource(self):
            if self._memory_resource is None:
                self._memory_resource = StreamOrderedResource()
            return self._memory_resource

        @memory_resource.setter
        def memory_resource(self, mr):
            self._memory_resource = mr

        def allocate(self, size, *, stream=None):  # keyword-only, as in cuda.core 1.2
            return self.memory_resource.allocate(size, stream)

        def create_stream(self):
            return CoreStream()

        def create_graph_builder(self):
            return GraphBuilder(CoreStream())

    core = types.ModuleType("cuda.core")
    core.Device, core.MemoryResource, core.Buffer = Device, MemoryResource, Buffer
    core.GraphMemoryResource = GraphMemoryResource
    graph = types.ModuleType("cuda.core.graph")
    graph.GraphBuilder = GraphBuilder
    return core, graph
