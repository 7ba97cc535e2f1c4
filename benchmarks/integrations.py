"""What capsafe.integrations.cupy costs CuPy, measured side by side in one run; summary last.

CuPy arrays are created in a tight loop under two allocators, rounds
alternating (see `gate.interleaved_ratio`): CuPy's own `MemoryPool` (base
allocator cudaMalloc/cudaFree) and the pool `install()` makes (base allocator
the gated facade's cuMemAlloc/cuMemFree).

1. Pool hits: `cupy.empty(n)` then drop it, so every allocation after the first
   is served from the pool (target: at most 1.05x).
2. Pool growth: `cupy.empty(n)`, drop it and `free_all_blocks()`, so every
   iteration allocates from and returns to the driver (target: at most 1.10x).

Run on a GPU with CuPy: PYTHONPATH=$PWD python3 benchmarks/integrations.py [--rounds R]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from gate import interleaved_ratio  # benchmarks/gate.py, beside this script

HIT_BYTES = 1 << 16
GROWTH_BYTES = 1 << 20


def loops(cupy: Any, pool: Any) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """(pool-hit loop, pool-growth loop) allocating through `pool` on this thread."""
    empty, uint8 = cupy.empty, cupy.uint8

    def hits(k: int) -> None:
        with cupy.cuda.using_allocator(pool.malloc):
            for _ in range(k):
                empty(HIT_BYTES, dtype=uint8)

    def growth(k: int) -> None:
        with cupy.cuda.using_allocator(pool.malloc):
            for _ in range(k):
                empty(GROWTH_BYTES, dtype=uint8)
                pool.free_all_blocks()

    return hits, growth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds (default 15)")
    args = parser.parse_args(argv)
    try:
        import cupy
    except ImportError as exc:
        print(f"SUMMARY integrations: skipped, CuPy is not importable ({exc})")
        return 0
    from capsafe import context, driver
    from capsafe.integrations.cupy import GatedAllocator

    facade = driver.get()
    context.device(0)
    plain_pool = cupy.cuda.MemoryPool()
    gated_pool = cupy.cuda.MemoryPool(GatedAllocator(cupy, facade).malloc)
    plain_hits, plain_growth = loops(cupy, plain_pool)
    gated_hits, gated_growth = loops(cupy, gated_pool)
    for warm in (plain_hits, gated_hits, plain_growth, gated_growth):
        warm(200)
    g_hit, p_hit, hit_ratio = interleaved_ratio(gated_hits, plain_hits, 20_000, args.rounds)
    g_grow, p_grow, grow_ratio = interleaved_ratio(gated_growth, plain_growth, 300, args.rounds)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device {name}, backend {driver.backend_choice()}, CuPy {cupy.__version__}")
    print(f"pool hits: gated {g_hit * 1e6:.2f} us vs plain {p_hit * 1e6:.2f} us per cupy.empty")
    print(f"pool growth: gated {g_grow * 1e6:.2f} us vs plain {p_grow * 1e6:.2f} us per iteration")
    hit_ok, grow_ok = hit_ratio <= 1.05, grow_ratio <= 1.10
    print(
        f"SUMMARY integrations: CuPy pool hits gated/plain {hit_ratio:.3f}x (target <= 1.05: "
        f"{'ok' if hit_ok else 'MISSED'}); pool growth {grow_ratio:.3f}x (target <= 1.10: "
        f"{'ok' if grow_ok else 'MISSED'})"
    )
    return 0 if hit_ok and grow_ok else 1


if __name__ == "__main__":
    sys.exit(main())
