"""The simulated driver's memory calls: allocations, copies and fills, and VMM.

They work on the current context's memory (`memory`): copies and fills are stream
work built here and run by the stream scheduler when something waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from capsafe.errors import cuda_error
from capsafe.handles import Device, DevicePtr, HostPtr, MemHandle, Stream
from capsafe.sim.calibration import ALLOCATION_GRANULARITY, TOTAL_MEMORY
from capsafe.sim.contexts import ContextState, SimDriverBase
from capsafe.sim.memory import Alloc, Mapping, Reservation, read_spans, write_spans
from capsafe.sim.streams import Node, StreamState, no_work


class MemoryCalls(SimDriverBase):
    """Device and host memory, synchronous and stream-ordered copies and fills, VMM."""

    # -- memory -----------------------------------------------------------------------
    def mem_alloc(self, size: int) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_alloc", "cuMemAlloc")
            region = ctx.memory.new_alloc(size, "cuMemAlloc")
            return DevicePtr(region.base, size=size)

    def mem_free(self, ptr: DevicePtr) -> None:
        with self._lock:
            ctx = self._enter("mem_free", "cuMemFree")
            region = ctx.memory.alloc_at(ptr, "cuMemFree")
            ctx.streams.drain_all()  # cuMemFree waits for the device
            ctx.memory.drop_region(region)

    def mem_alloc_async(self, size: int, stream: Stream) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_alloc_async", "cuMemAllocAsync", stream)
            ss = self._stream(ctx, stream, "cuMemAllocAsync")
            ss.check_not_invalidated("cuMemAllocAsync")
            region = ctx.memory.new_alloc(size, "cuMemAllocAsync")
            if ss.capture is not None:
                region.graph_owned = True
                ss.capture.owned.append(region)
            ctx.streams.submit(ss, no_work, "cuMemAllocAsync")
            return DevicePtr(region.base, size=size)

    def mem_free_async(self, ptr: DevicePtr, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("mem_free_async", "cuMemFreeAsync", stream)
            ss = self._stream(ctx, stream, "cuMemFreeAsync")
            found = ctx.memory.regions.get(int(ptr))
            if isinstance(found, Alloc) and found.graph_owned and ss.capture is not None:
                ctx.streams.submit(ss, no_work, "cuMemFreeAsync")
                return
            region = ctx.memory.alloc_at(ptr, "cuMemFreeAsync")
            memory = ctx.memory

            def free(s: StreamState, seq: int) -> Callable[[], None]:
                return lambda: memory.drop_if_live(region)

            ctx.streams.submit(ss, free, "cuMemFreeAsync")
            if ss.capture is None:
                region.freeing = True

    def mem_host_alloc(self, size: int) -> HostPtr:
        with self._lock:
            ctx = self._enter("mem_host_alloc", "cuMemHostAlloc")
            return ctx.memory.new_host(size, "cuMemHostAlloc")

    def mem_free_host(self, ptr: HostPtr) -> None:
        with self._lock:
            ctx = self._enter("mem_free_host", "cuMemFreeHost")
            if not isinstance(ptr, HostPtr) or ptr.value not in ctx.memory.hosts:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE", "cuMemFreeHost", "not a live cuMemHostAlloc pointer"
                )
            del ctx.memory.hosts[ptr.value]

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            ctx = self._enter("mem_get_info", "cuMemGetInfo")
            return TOTAL_MEMORY - ctx.memory.used, TOTAL_MEMORY

    @staticmethod
    def _htod(ctx: ContextState, dst: DevicePtr, src: Any, symbol: str) -> Node:
        memory = ctx.memory
        view = memory.host_view(src, writable=False, symbol=symbol)
        memory.device_span(dst, view.nbytes, symbol)

        def node(s: StreamState, seq: int) -> Callable[[], None]:
            spans = memory.device_span(dst, view.nbytes, symbol)
            return lambda: write_spans(spans, view)

        return node

    @staticmethod
    def _dtoh(ctx: ContextState, dst: Any, src: DevicePtr, size: int | None, symbol: str) -> Node:
        memory = ctx.memory
        view = memory.host_view(dst, writable=True, symbol=symbol)
        n = view.nbytes if size is None else size
        if n > view.nbytes:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{n} bytes do not fit the {view.nbytes}-byte destination",
            )
        memory.device_span(src, n, symbol)

        def node(s: StreamState, seq: int) -> Callable[[], None]:
            spans = memory.device_span(src, n, symbol)
            return lambda: read_spans(spans, view)

        return node

    @staticmethod
    def _memset(ctx: ContextState, ptr: DevicePtr, value: int, count: int, symbol: str) -> Node:
        if not 0 <= int(value) <= 255:
            raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, f"byte value {value!r}")
        memory = ctx.memory
        memory.device_span(ptr, count, symbol)

        def node(s: StreamState, seq: int) -> Callable[[], None]:
            spans = memory.device_span(ptr, count, symbol)

            def run() -> None:
                for backing, offset, length in spans:
                    backing.fill(offset, length, int(value))

            return run

        return node

    def memcpy_htod(self, dst: DevicePtr, src: Any) -> None:
        with self._lock:
            ctx = self._enter("memcpy_htod", "cuMemcpyHtoD")
            ctx.streams.run_sync(self._htod(ctx, dst, src, "cuMemcpyHtoD"), "cuMemcpyHtoD")

    def memcpy_dtoh(self, dst: Any, src: DevicePtr, size: int | None = None) -> None:
        with self._lock:
            ctx = self._enter("memcpy_dtoh", "cuMemcpyDtoH")
            node = self._dtoh(ctx, dst, src, size, "cuMemcpyDtoH")
            ctx.streams.run_sync(node, "cuMemcpyDtoH")

    def memcpy_htod_async(self, dst: DevicePtr, src: Any, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("memcpy_htod_async", "cuMemcpyHtoDAsync", stream)
            ss = self._stream(ctx, stream, "cuMemcpyHtoDAsync")
            node = self._htod(ctx, dst, src, "cuMemcpyHtoDAsync")
            ctx.streams.submit(ss, node, "cuMemcpyHtoDAsync")

    def memcpy_dtoh_async(
        self, dst: Any, src: DevicePtr, stream: Stream, size: int | None = None
    ) -> None:
        with self._lock:
            ctx = self._enter("memcpy_dtoh_async", "cuMemcpyDtoHAsync", stream)
            ss = self._stream(ctx, stream, "cuMemcpyDtoHAsync")
            node = self._dtoh(ctx, dst, src, size, "cuMemcpyDtoHAsync")
            ctx.streams.submit(ss, node, "cuMemcpyDtoHAsync")

    def memset_d8(self, ptr: DevicePtr, value: int, count: int) -> None:
        with self._lock:
            ctx = self._enter("memset_d8", "cuMemsetD8")
            ctx.streams.run_sync(self._memset(ctx, ptr, value, count, "cuMemsetD8"), "cuMemsetD8")

    def memset_d8_async(self, ptr: DevicePtr, value: int, count: int, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("memset_d8_async", "cuMemsetD8Async", stream)
            ss = self._stream(ctx, stream, "cuMemsetD8Async")
            node = self._memset(ctx, ptr, value, count, "cuMemsetD8Async")
            ctx.streams.submit(ss, node, "cuMemsetD8Async")

    # -- virtual memory management --------------------------------------------------
    def mem_get_allocation_granularity(self, device: Device) -> int:
        with self._lock:
            self._ready("cuMemGetAllocationGranularity")
            self._device(device, "cuMemGetAllocationGranularity")
            return ALLOCATION_GRANULARITY

    def mem_create(self, size: int, device: Device) -> MemHandle:
        with self._lock:
            ctx = self._enter("mem_create", "cuMemCreate")
            self._device(device, "cuMemCreate")
            physical = ctx.memory.new_physical(size, "cuMemCreate")
            handle = MemHandle(next(self._ids), size=size)
            ctx.memory.physical[handle.value] = physical
            return handle

    def mem_address_reserve(self, size: int, alignment: int = 0) -> DevicePtr:
        with self._lock:
            ctx = self._enter("mem_address_reserve", "cuMemAddressReserve")
            region = ctx.memory.reserve_range(size, alignment, "cuMemAddressReserve")
            return DevicePtr(region.base, size=size)

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        with self._lock:
            ctx = self._enter("mem_map", "cuMemMap")
            region, offset = ctx.memory.reserved_range(ptr, size, "cuMemMap")
            physical = self._lookup(ctx.memory.physical, handle, MemHandle, "cuMemMap")
            if size > physical.size:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemMap",
                    f"{size} bytes exceed the {physical.size}-byte allocation",
                )
            if any(
                m.offset < offset + size and offset < m.offset + m.size for m in region.mappings
            ):
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE", "cuMemMap", "the range is already mapped"
                )
            region.mappings.append(Mapping(offset, size, physical))
            physical.mappings += 1

    def mem_set_access(self, ptr: DevicePtr, size: int, device: Device) -> None:
        with self._lock:
            ctx = self._enter("mem_set_access", "cuMemSetAccess")
            self._device(device, "cuMemSetAccess")
            region, offset = ctx.memory.reserved_range(ptr, size, "cuMemSetAccess")
            mappings = region.covering(offset, size)
            if mappings is None:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE", "cuMemSetAccess", "the range is not fully mapped"
                )
            for mapping in mappings:
                mapping.accessible = True

    def mem_unmap(self, ptr: DevicePtr, size: int) -> None:
        with self._lock:
            ctx = self._enter("mem_unmap", "cuMemUnmap")
            region, offset = ctx.memory.reserved_range(ptr, size, "cuMemUnmap")
            mappings = region.covering(offset, size)
            if mappings is None or any(
                m.offset < offset or m.offset + m.size > offset + size for m in mappings
            ):
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemUnmap",
                    "the range must cover whole mappings without gaps",
                )
            for mapping in mappings:
                region.mappings.remove(mapping)
                mapping.physical.mappings -= 1
                ctx.memory.maybe_free_physical(mapping.physical)

    def mem_release(self, handle: MemHandle) -> None:
        with self._lock:
            ctx = self._enter("mem_release", "cuMemRelease")
            physical = self._lookup(ctx.memory.physical, handle, MemHandle, "cuMemRelease")
            del ctx.memory.physical[handle.value]
            physical.released = True  # the memory lives on while it is still mapped
            ctx.memory.maybe_free_physical(physical)

    def mem_address_free(self, ptr: DevicePtr, size: int) -> None:
        with self._lock:
            ctx = self._enter("mem_address_free", "cuMemAddressFree")
            region = ctx.memory.regions.get(int(ptr))
            if not isinstance(region, Reservation) or region.size != size:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemAddressFree",
                    "not a reserved range with that base and size",
                )
            if region.mappings:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_VALUE",
                    "cuMemAddressFree",
                    "the range still has mappings; unmap them first",
                )
            ctx.memory.drop_region(region)
