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

`--null` needs no GPU and no torch: the same captures over a torch whose calls do nothing
(null_torch.py), so what it times is the integration's own Python per capture; it also
counts the Python function calls a protected capture adds (sys.setprofile).
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
    parser.add_argument(
        "--null", action="store_true", help="over a torch that does nothing (no GPU needed)"
    )
    args = parser.parse_args(argv)
    if args.null:
        return null_main(args.rounds)
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


NULL_ITERATIONS = 5000


def null_loop(torch: Any, mode: str) -> Callable[[int], None]:
    """`k` captures with `torch.cuda.graph` over the null torch (nothing inside, no replay)."""

    def loop(k: int) -> None:
        for _ in range(k):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode=mode):
                pass

    return loop


def python_calls(loop: Callable[[int], None], k: int) -> float:
    """Python function calls per iteration of `loop` (profiler "call" events)."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        loop(k)
    finally:
        sys.setprofile(None)
    return calls / k


def null_main(rounds: int) -> int:
    """The integration's own cost per capture, over the null torch; the added µs last."""
    import null_torch  # benchmarks/null_torch.py, beside this script

    from capsafe import driver
    from capsafe.integrations import torch as integration

    torch = null_torch.install()
    print(f"backend {driver.backend_choice()}, policy {driver.get().policy}")  # type: ignore[attr-defined]
    added: dict[str, float] = {}
    for mode in ("global", "thread_local", "relaxed"):
        plain = null_loop(torch, mode)
        gated = protected(plain)
        for warm in (plain, gated):
            warm(NULL_ITERATIONS // 10)
        g, p, _ = interleaved_ratio(gated, plain, NULL_ITERATIONS, rounds)
        added[mode] = (g - p) * 1e6
        bare = python_calls(plain, 200)
        with integration.installed():
            extra = python_calls(plain, 200) - bare
        print(
            f"{mode}: protected {g * 1e6:.2f} us vs unprotected {p * 1e6:.2f} us per capture: "
            f"+{added[mode]:.2f} us, +{extra:.0f} Python calls"
        )
    worst = max(added, key=lambda m: added[m])
    print(
        f"SUMMARY torch_protect --null: the integration adds {added[worst]:.2f} us per "
        f"capture at worst ({worst}) over a torch that does nothing"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
