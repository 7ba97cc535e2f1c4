"""Device memory of one simulated context: real bytes, fake addresses, VMM state, accounting.

Allocations are backed by pages created on first write, so a huge allocation
costs nothing on the host until it is filled. Addresses count up and are never
reused, so a use after free fails instead of landing in a newer allocation.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from capsafe.backend import host_view
from capsafe.errors import UsageError, cuda_error
from capsafe.handles import DevicePtr, HostPtr
from capsafe.sim.calibration import ALIGNMENT, ALLOCATION_GRANULARITY, MIB, TOTAL_MEMORY

DEVICE_BASE = 0x7F00_0000_0000
HOST_BASE = 0x7E00_0000_0000
HOST_PAGE = 4096
PAGE = MIB  # bytes are stored in pages of up to this size, created on first write


def align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class Backing:
    """Bytes of one allocation, stored in pages created on first write (zero until then)."""

    __slots__ = ("page", "pages", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.page = max(1, min(PAGE, size))
        self.pages: dict[int, bytearray] = {}

    def _spans(self, offset: int, n: int) -> Iterator[tuple[int, int, int, int]]:
        """(page index, start in page, length, position in the request) over [offset, offset+n)."""
        pos = 0
        while pos < n:
            index, start = divmod(offset + pos, self.page)
            length = min(self.page - start, n - pos)
            yield index, start, length, pos
            pos += length

    def read(self, offset: int, n: int) -> bytes:
        out = bytearray(n)
        for index, start, length, pos in self._spans(offset, n):
            page = self.pages.get(index)
            if page is not None:
                out[pos : pos + length] = page[start : start + length]
        return bytes(out)

    def _page(self, index: int) -> bytearray:
        page = self.pages.get(index)
        if page is None:
            page = self.pages[index] = bytearray(self.page)
        return page

    def write(self, offset: int, data: memoryview) -> None:
        for index, start, length, pos in self._spans(offset, data.nbytes):
            self._page(index)[start : start + length] = data[pos : pos + length]

    def fill(self, offset: int, n: int, value: int) -> None:
        for index, start, length, _ in self._spans(offset, n):
            if value == 0 and length == self.page:
                self.pages.pop(index, None)
            else:
                self._page(index)[start : start + length] = bytes((value,)) * length


Span = tuple[Backing, int, int]  # (backing, offset in it, length)


def write_spans(spans: list[Span], data: memoryview) -> None:
    pos = 0
    for backing, offset, length in spans:
        backing.write(offset, data[pos : pos + length])
        pos += length


def read_spans(spans: list[Span], into: memoryview) -> None:
    pos = 0
    for backing, offset, length in spans:
        into[pos : pos + length] = backing.read(offset, length)
        pos += length


@dataclass(eq=False)
class Alloc:
    base: int
    size: int
    backing: Backing
    graph_owned: bool = False  # allocated during a capture: the graph frees it
    freeing: bool = False  # a stream-ordered free is pending


@dataclass(eq=False)
class Physical:
    """A cuMemCreate allocation."""

    size: int
    backing: Backing
    released: bool = False
    mappings: int = 0


@dataclass(eq=False)
class Mapping:
    offset: int
    size: int
    physical: Physical
    accessible: bool = False


@dataclass(eq=False)
class Reservation:
    base: int
    size: int
    mappings: list[Mapping] = field(default_factory=list)

    def covering(self, offset: int, n: int) -> list[Mapping] | None:
        """The mappings that cover [offset, offset+n) without a gap, in order, else None."""
        found: list[Mapping] = []
        pos = offset
        for mapping in sorted(self.mappings, key=lambda m: m.offset):
            if mapping.offset + mapping.size <= pos or pos >= offset + n:
                continue
            if mapping.offset > pos:
                return None
            found.append(mapping)
            pos = mapping.offset + mapping.size
        return found if pos >= offset + n else None


Region = Alloc | Reservation


class AddressSpace:
    """The process's fake virtual addresses: one counter for device memory, one for host."""

    def __init__(self) -> None:
        self._device = DEVICE_BASE
        self._host = HOST_BASE

    def device(self, size: int, alignment: int) -> int:
        base = align(self._device, alignment)
        self._device = align(base + size, ALIGNMENT)
        return base

    def host(self, size: int) -> int:
        base = self._host
        self._host = align(base + size, HOST_PAGE)
        return base


def check_granular(value: int, what: str, symbol: str) -> None:
    if value <= 0 or value % ALLOCATION_GRANULARITY:
        raise cuda_error(
            "CUDA_ERROR_INVALID_VALUE",
            symbol,
            f"{what} {value} is not a positive multiple of "
            f"the {ALLOCATION_GRANULARITY}-byte granularity",
        )


class ContextMemory:
    """What one context owns in memory, by base address, and the bytes it accounts for."""

    def __init__(self, addresses: AddressSpace) -> None:
        self.addresses = addresses
        self.regions: dict[int, Region] = {}
        self.bases: list[int] = []
        self.physical: dict[int, Physical] = {}
        self.hosts: dict[int, HostPtr] = {}
        self.used = 0

    # -- regions -----------------------------------------------------------------
    def add_region(self, region: Region) -> None:
        self.regions[region.base] = region
        bisect.insort(self.bases, region.base)

    def drop_region(self, region: Region) -> None:
        del self.regions[region.base]
        self.bases.remove(region.base)
        if isinstance(region, Alloc):
            self.used -= align(region.size, ALIGNMENT)

    def drop_if_live(self, region: Alloc) -> None:
        """Free `region` unless something already did (a graph and a stream-ordered free)."""
        if self.regions.get(region.base) is region:
            self.drop_region(region)

    def region_at(self, address: int) -> Region | None:
        index = bisect.bisect_right(self.bases, address) - 1
        if index < 0:
            return None
        region = self.regions[self.bases[index]]
        return region if address < region.base + region.size else None

    def resolve(
        self, address: int, n: int, symbol: str, result: str = "CUDA_ERROR_INVALID_VALUE"
    ) -> list[Span]:
        """The bytes behind [address, address+n): one span per allocation or mapping touched."""
        if n < 0:
            raise cuda_error(result, symbol, f"negative size {n}")
        region = self.region_at(address)
        if region is None or address + n > region.base + region.size:
            raise cuda_error(
                result, symbol, f"{n} bytes at {address:#x} are not inside one allocation"
            )
        offset = address - region.base
        if isinstance(region, Alloc):
            return [(region.backing, offset, n)] if n else []
        mappings = region.covering(offset, n)
        if mappings is None or not all(m.accessible for m in mappings):
            raise cuda_error(result, symbol, f"{address:#x}+{n} is not mapped and accessible")
        spans: list[Span] = []
        pos, end = offset, offset + n
        for m in mappings:
            length = min(m.offset + m.size, end) - pos
            spans.append((m.physical.backing, pos - m.offset, length))
            pos += length
        return spans

    def device_span(self, ptr: DevicePtr, n: int, symbol: str) -> list[Span]:
        if not isinstance(ptr, DevicePtr):
            raise UsageError(f"{symbol}: expected a DevicePtr, got {type(ptr).__name__}")
        return self.resolve(ptr.value, n, symbol)

    def host_view(self, buffer: Any, *, writable: bool, symbol: str) -> memoryview:
        if isinstance(buffer, HostPtr):
            if self.hosts.get(buffer.value) is None:
                raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, "host memory was freed")
            buffer = buffer.buffer
        return host_view(buffer, writable=writable)

    # -- allocations -------------------------------------------------------------
    def reserve_bytes(self, size: int, symbol: str) -> None:
        if self.used + size > TOTAL_MEMORY:
            free_mib = (TOTAL_MEMORY - self.used) // MIB
            raise cuda_error(
                "CUDA_ERROR_OUT_OF_MEMORY",
                symbol,
                f"asked for {size} bytes with {free_mib} MiB free",
            )
        self.used += size

    def new_alloc(self, size: int, symbol: str) -> Alloc:
        if not isinstance(size, int) or size <= 0:
            raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, f"size {size!r}")
        self.reserve_bytes(align(size, ALIGNMENT), symbol)
        region = Alloc(self.addresses.device(size, ALIGNMENT), size, Backing(size))
        self.add_region(region)
        return region

    def alloc_at(self, ptr: DevicePtr, symbol: str) -> Alloc:
        region = self.regions.get(int(ptr))
        if not isinstance(region, Alloc) or region.freeing or region.graph_owned:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{int(ptr):#x} is not the start of a live allocation",
            )
        return region

    def new_host(self, size: int, symbol: str) -> HostPtr:
        if not isinstance(size, int) or size <= 0:
            raise cuda_error("CUDA_ERROR_INVALID_VALUE", symbol, f"size {size!r}")
        base = self.addresses.host(size)
        handle = HostPtr(base, size=size, buffer=memoryview(bytearray(size)))
        self.hosts[base] = handle
        return handle

    # -- virtual memory management -----------------------------------------------
    def new_physical(self, size: int, symbol: str) -> Physical:
        check_granular(size, "size", symbol)
        self.reserve_bytes(size, symbol)
        return Physical(size, Backing(size))

    def reserve_range(self, size: int, alignment: int, symbol: str) -> Reservation:
        check_granular(size, "size", symbol)
        if alignment < 0 or alignment & (alignment - 1):
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE", symbol, f"alignment {alignment} is not a power of two"
            )
        base = self.addresses.device(size, max(alignment, ALLOCATION_GRANULARITY))
        region = Reservation(base, size)
        self.add_region(region)
        return region

    def reserved_range(self, ptr: DevicePtr, size: int, symbol: str) -> tuple[Reservation, int]:
        """The reservation holding [ptr, ptr+size) and the offset of ptr in it."""
        region = self.region_at(int(ptr))
        if not isinstance(region, Reservation) or int(ptr) + size > region.base + region.size:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE",
                symbol,
                f"{int(ptr):#x}+{size} is not inside a reserved address range",
            )
        offset = int(ptr) - region.base
        check_granular(size, "size", symbol)
        if offset % ALLOCATION_GRANULARITY:
            raise cuda_error(
                "CUDA_ERROR_INVALID_VALUE", symbol, f"{int(ptr):#x} is not granularity-aligned"
            )
        return region, offset

    def maybe_free_physical(self, physical: Physical) -> None:
        if physical.released and physical.mappings == 0:
            self.used -= physical.size
