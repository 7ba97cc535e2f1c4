import sys
import time

import pytest

import capsafe
from capsafe import driver

N = 1 << 20
READ_S = 0.6  # long enough to see several of the neighbours' allocations


@pytest.fixture(autouse=True)
def often_switching_threads():
    # A real driver call releases the GIL while the device works; the simulated one does
    # not, so hand the GIL over as often as a driver call would, and restore it after.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@pytest.mark.thread_unsafe(reason="asserts the device's free memory, which other threads move")
def test_free_memory_is_steady():
    # Reads process-wide state: the device's free memory, which any thread's allocation
    # moves. Alone it holds; beside neighbour threads that allocate, it does not.
    capsafe.device(0)
    drv = driver.get(gated=False)
    first = drv.mem_get_info()[0]
    end = time.monotonic() + READ_S
    while time.monotonic() < end:
        assert drv.mem_get_info()[0] == first


def test_pool_counter_moves_by_what_it_allocated():
    # A pool counter (bytes in use, as CuPy's memory-pool tests assert): it grows by exactly
    # this test's allocation only when no other thread allocates or frees meanwhile.
    capsafe.device(0)
    drv = driver.get(gated=False)
    end = time.monotonic() + READ_S
    while time.monotonic() < end:
        before = drv.mem_get_info()[0]
        ptr = drv.mem_alloc(N)
        after = drv.mem_get_info()[0]
        drv.mem_free(ptr)
        assert before - after == N


def test_computes():
    # Touches no device: the control.
    assert sum(range(10)) == 45
