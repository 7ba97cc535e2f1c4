"""What capsafe.integrations.torch costs a torch.cuda.graph loop, measured in one run; summary last.

Each iteration captures a small graph with `torch.cuda.graph` (which synchronizes and
empties the caching allocator's cache before it begins), instantiates it, and replays it
REPLAYS times; the loop ends with `torch.cuda.synchronize()`. Rounds alternate between
the loop with the integration installed (every capture a gate window; torch's
synchronize, empty_cache and the stream and event synchronizes in the gate's shared side)
and without it (see `gate.interleaved_ratio`); installing and uninstalling happen inside
each protected round, so they are counted too. One ratio per capture mode; the summary
line gives the worst (target: at most 1.05x).

Run on a GPU with torch: PYTHONPATH=$PWD python3 benchmarks/torch_protect.py [--rounds R]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from gate import interleaved_ratio  # benchmarks/gate.py, beside this script

ELEMENTS = 1 << 16
REPLAYS = 10
ITERATIONS = 200
TARGET = 1.05


def capture_and_replay(torch: Any, mode: str) -> Callable[[int], None]:
    """The loop: `k` captures of one graph in `mode`, each replayed REPLAYS times."""
    x = torch.ones(ELEMENTS, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()

    def loop(k: int) -> None:
        for _ in range(k):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream, capture_error_mode=mode):
                out.copy_(x * 2 + 1)
            for _ in range(REPLAYS):
                g.replay()
        torch.cuda.synchronize()

    return loop


def protected(loop: Callable[[int], None]) -> Callable[[int], None]:
    """`loop` with capsafe.integrations.torch installed for the round."""
    from capsafe.integrations import torch as integration

    def run(k: int) -> None:
        with integration.installed():
            loop(k)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds (default 15)")
    args = parser.parse_args(argv)
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        print(f"SUMMARY torch_protect: skipped, torch is not importable ({exc})")
        return 0
    if not torch.cuda.is_available():
        print("SUMMARY torch_protect: skipped, torch sees no CUDA device")
        return 0
    from capsafe import context, driver

    context.device(0)
    ratios: dict[str, float] = {}
    for mode in ("global", "thread_local", "relaxed"):
        plain = capture_and_replay(torch, mode)
        gated = protected(plain)
        for warm in (plain, gated):
            warm(20)
        g, p, ratios[mode] = interleaved_ratio(gated, plain, ITERATIONS, args.rounds)
        print(
            f"{mode}: protected {g * 1e6:.1f} us vs unprotected {p * 1e6:.1f} us per capture "
            f"and {REPLAYS} replays ({ratios[mode]:.3f}x)"
        )
    print(
        f"device {torch.cuda.get_device_name(0)}, backend {driver.backend_choice()}, "
        f"torch {torch.__version__}"
    )
    worst = max(ratios, key=lambda m: ratios[m])
    ok = ratios[worst] <= TARGET
    print(
        f"SUMMARY torch_protect: protected/unprotected capture-and-replay loop "
        f"{ratios[worst]:.3f}x at worst ({worst}; target <= {TARGET}: "
        f"{'ok' if ok else 'MISSED'})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
