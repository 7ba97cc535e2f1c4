"""Simulated device memory: real bytes, real bounds, real accounting, the VMM state machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from capsafe.errors import CudaError, UsageError
from capsafe.handles import DevicePtr
from capsafe.sim import SimBackend
from capsafe.sim.calibration import ALIGNMENT, ALLOCATION_GRANULARITY, TOTAL_MEMORY
from capsafe.sim.memory import DEVICE_BASE

GRAN = ALLOCATION_GRANULARITY


def result_of(fn: Callable[..., object], *args: object) -> str:
    with pytest.raises(CudaError) as info:
        fn(*args)
    return info.value.result


def test_htod_dtoh_round_trip(sim_backend: SimBackend) -> None:
    b = sim_backend
    ptr = b.mem_alloc(1000)
    payload = bytes(range(256)) * 3 + b"tail"
    b.memcpy_htod(ptr, payload)
    out = bytearray(len(payload))
    b.memcpy_dtoh(out, ptr)
    assert out == payload


def test_fresh_memory_reads_zero_and_memset_fills(sim_backend: SimBackend) -> None:
    b = sim_backend
    ptr = b.mem_alloc(3 << 20)  # spans several storage pages
    out = bytearray(3 << 20)
    b.memcpy_dtoh(out, ptr)
    assert out.count(0) == len(out)
    b.memset_d8(ptr + 100, 0xAB, (2 << 20) + 5)
    b.memcpy_dtoh(out, ptr)
    assert out[:100].count(0) == 100
    assert out[100 : 100 + (2 << 20) + 5].count(0xAB) == (2 << 20) + 5
    assert out[100 + (2 << 20) + 5 :].count(0) == len(out) - 100 - (2 << 20) - 5


def test_pointers_are_aligned_distinct_and_in_the_device_range(sim_backend: SimBackend) -> None:
    ptrs = [sim_backend.mem_alloc(n) for n in (1, 7, 300, 4096)]
    assert all(p.value % ALIGNMENT == 0 and p.value >= DEVICE_BASE for p in ptrs)
    assert len({p.value for p in ptrs}) == len(ptrs)
    assert [p.size for p in ptrs] == [1, 7, 300, 4096]


def test_offsets_inside_an_allocation(sim_backend: SimBackend) -> None:
    b = sim_backend
    ptr = b.mem_alloc(64)
    b.memcpy_htod(ptr + 60, b"wxyz")
    out = bytearray(2)
    b.memcpy_dtoh(out, ptr + 61)
    assert out == b"xy"
    part = bytearray(8)
    b.memcpy_dtoh(part, ptr + 56, size=4)
    assert part == bytes(8)  # only 4 bytes copied, all zero
    b.memcpy_dtoh(part, ptr + 56)
    assert part == bytes(4) + b"wxyz"


@pytest.mark.parametrize(
    "action",
    [
        lambda b, p: b.memcpy_htod(p + 60, b"12345"),
        lambda b, p: b.memcpy_dtoh(bytearray(65), p),
        lambda b, p: b.memset_d8(p, 1, 65),
        lambda b, p: b.memcpy_htod(p + 64, b"1"),
        lambda b, p: b.memcpy_dtoh(bytearray(4), p, size=5),
        lambda b, p: b.memset_d8(p, 256, 1),
        lambda b, p: b.mem_free(p + 8),
    ],
    ids=[
        "htod-past-end",
        "dtoh-past-end",
        "memset-past-end",
        "htod-at-end",
        "size-over-dst",
        "byte-over-255",
        "free-interior",
    ],
)
def test_out_of_range_access_is_invalid_value(
    sim_backend: SimBackend, action: Callable[[SimBackend, DevicePtr], object]
) -> None:
    ptr = sim_backend.mem_alloc(64)
    assert result_of(action, sim_backend, ptr) == "CUDA_ERROR_INVALID_VALUE"


def test_freed_memory_cannot_be_used_or_freed_again(sim_backend: SimBackend) -> None:
    b = sim_backend
    ptr = b.mem_alloc(16)
    b.mem_free(ptr)
    assert result_of(b.memcpy_htod, ptr, b"x") == "CUDA_ERROR_INVALID_VALUE"
    assert result_of(b.mem_free, ptr) == "CUDA_ERROR_INVALID_VALUE"
    assert b.mem_alloc(16).value != ptr.value  # addresses are never reused


def test_zero_and_negative_sizes_are_refused(sim_backend: SimBackend) -> None:
    assert result_of(sim_backend.mem_alloc, 0) == "CUDA_ERROR_INVALID_VALUE"
    assert result_of(sim_backend.mem_alloc, -5) == "CUDA_ERROR_INVALID_VALUE"
    assert result_of(sim_backend.mem_host_alloc, 0) == "CUDA_ERROR_INVALID_VALUE"


def test_mem_get_info_follows_allocations_and_oom(sim_backend: SimBackend) -> None:
    b = sim_backend
    free0, total = b.mem_get_info()
    assert total == TOTAL_MEMORY == 150_109_880_320
    assert free0 == total
    big = b.mem_alloc(100 << 30)  # lazily backed: costs nothing on the host
    assert b.mem_get_info()[0] == free0 - (100 << 30)
    assert result_of(b.mem_alloc, 50 << 30) == "CUDA_ERROR_OUT_OF_MEMORY"
    b.mem_free(big)
    assert b.mem_get_info()[0] == free0


def test_host_memory_is_a_writable_buffer_usable_for_copies(sim_backend: SimBackend) -> None:
    b = sim_backend
    host = b.mem_host_alloc(8)
    host.buffer[:] = b"pinned!!"
    ptr = b.mem_alloc(8)
    b.memcpy_htod(ptr, host)
    back = b.mem_host_alloc(8)
    b.memcpy_dtoh(back, ptr)
    assert bytes(back.buffer) == b"pinned!!"
    b.mem_free_host(host)
    assert result_of(b.mem_free_host, host) == "CUDA_ERROR_INVALID_VALUE"
    assert result_of(b.memcpy_htod, ptr, host) == "CUDA_ERROR_INVALID_VALUE"


def test_host_buffers_must_be_contiguous_and_destinations_writable(
    sim_backend: SimBackend,
) -> None:
    ptr = sim_backend.mem_alloc(8)
    with pytest.raises(UsageError, match="read-only"):
        sim_backend.memcpy_dtoh(b"immutable", ptr)
    with pytest.raises(UsageError, match="contiguous"):
        sim_backend.memcpy_htod(ptr, memoryview(bytearray(16))[::2])
    with pytest.raises(UsageError, match="DevicePtr"):
        address: Any = ptr.value  # an int where a DevicePtr belongs
        sim_backend.memset_d8(address, 0, 1)


# -- VMM ---------------------------------------------------------------------------------


def test_vmm_full_cycle_reads_and_writes_through_the_mapping(sim_backend: SimBackend) -> None:
    b = sim_backend
    dev = b.device_get(0)
    assert b.mem_get_allocation_granularity(dev) == GRAN
    free0 = b.mem_get_info()[0]
    h1, h2 = b.mem_create(GRAN, dev), b.mem_create(GRAN, dev)
    assert b.mem_get_info()[0] == free0 - 2 * GRAN
    va = b.mem_address_reserve(2 * GRAN)
    assert va.value % GRAN == 0
    b.mem_map(va, GRAN, h1)
    b.mem_map(va + GRAN, GRAN, h2)
    b.mem_set_access(va, 2 * GRAN, dev)
    b.memcpy_htod(va + (GRAN - 2), b"abcd")  # straddles the two physical allocations
    out = bytearray(4)
    b.memcpy_dtoh(out, va + (GRAN - 2))
    assert out == b"abcd"
    b.mem_unmap(va, 2 * GRAN)
    b.mem_release(h1)
    b.mem_release(h2)
    b.mem_address_free(va, 2 * GRAN)
    assert b.mem_get_info()[0] == free0


def test_vmm_state_checks(sim_backend: SimBackend) -> None:
    b = sim_backend
    dev = b.device_get(0)
    handle = b.mem_create(GRAN, dev)
    va = b.mem_address_reserve(GRAN)
    plain = b.mem_alloc(GRAN)
    assert result_of(b.mem_create, GRAN + 1, dev) == "CUDA_ERROR_INVALID_VALUE"
    assert result_of(b.mem_map, plain, GRAN, handle) == "CUDA_ERROR_INVALID_VALUE"  # not reserved
    assert result_of(b.memcpy_htod, va, b"x") == "CUDA_ERROR_INVALID_VALUE"  # not mapped
    assert result_of(b.mem_set_access, va, GRAN, dev) == "CUDA_ERROR_INVALID_VALUE"
    b.mem_map(va, GRAN, handle)
    assert result_of(b.memcpy_htod, va, b"x") == "CUDA_ERROR_INVALID_VALUE"  # no access yet
    assert result_of(b.mem_map, va, GRAN, handle) == "CUDA_ERROR_INVALID_VALUE"  # mapped twice
    b.mem_set_access(va, GRAN, dev)
    b.memcpy_htod(va, b"x")
    assert result_of(b.mem_address_free, va, GRAN) == "CUDA_ERROR_INVALID_VALUE"  # still mapped
    b.mem_release(handle)  # allowed while mapped: the memory lives until unmapped
    b.memcpy_htod(va, b"y")
    assert result_of(b.mem_release, handle) == "CUDA_ERROR_INVALID_HANDLE"
    b.mem_unmap(va, GRAN)
    assert result_of(b.mem_unmap, va, GRAN) == "CUDA_ERROR_INVALID_VALUE"
    b.mem_address_free(va, GRAN)
    assert result_of(b.mem_address_free, va, GRAN) == "CUDA_ERROR_INVALID_VALUE"


def test_vmm_release_while_mapped_frees_at_unmap(sim_backend: SimBackend) -> None:
    b = sim_backend
    dev = b.device_get(0)
    free0 = b.mem_get_info()[0]
    handle = b.mem_create(GRAN, dev)
    va = b.mem_address_reserve(GRAN)
    b.mem_map(va, GRAN, handle)
    b.mem_release(handle)
    assert b.mem_get_info()[0] == free0 - GRAN
    b.mem_unmap(va, GRAN)
    assert b.mem_get_info()[0] == free0
