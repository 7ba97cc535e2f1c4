"""What the capsafe plugin costs: 2,000 trivial tests, records on vs the plugin disabled.

Both variants run side by side in alternating order (so drift in machine load
hits both), several times each; the medians are compared. Two ratios: the whole
process (what a person waits for) and pytest's own session time (the per-test
hooks alone, without interpreter start-up). Target: at most 1.10x.

    python benchmarks/plugin_overhead.py [--tests 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SESSION_TIME = re.compile(r" in ([0-9.]+)s")
TESTS_PER_MODULE = 100


def write_suite(root: Path, tests: int) -> None:
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider -p no:xdist\n")
    for m in range(0, tests, TESTS_PER_MODULE):
        body = "".join(
            f"def test_{n}():\n    assert {n} + 1 > {n}\n\n"
            for n in range(m, min(m + TESTS_PER_MODULE, tests))
        )
        (root / f"test_m{m // TESTS_PER_MODULE:03d}.py").write_text(body)


def run(root: Path, extra: list[str]) -> tuple[float, float]:
    """(wall seconds, pytest session seconds) of one quiet run."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *extra],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"pytest failed ({proc.returncode}):\n{proc.stdout[-2000:]}")
    found = SESSION_TIME.findall(proc.stdout)
    return wall, float(found[-1]) if found else wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=2000, help="trivial tests to generate")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant")
    args = parser.parse_args()
    if args.tests < 1 or args.repeats < 1:
        parser.error("--tests and --repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="capsafe-overhead-") as tmp:
        root = Path(tmp) / "suite"
        root.mkdir()
        write_suite(root, args.tests)
        variants = {
            "off": lambda k: ["-p", "no:capsafe"],
            "records": lambda k: [
                f"--capsafe-records={Path(tmp) / f'rec{k}'}",
                "--capsafe-seed=1",
                "--capsafe-shuffle=none",
            ],
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        run(root, variants["off"](0))  # warm the file cache and bytecode
        for k in range(args.repeats):
            names = list(variants) if k % 2 == 0 else list(reversed(variants))
            for name in names:
                samples[name].append(run(root, variants[name](k)))
        wall = {n: statistics.median(w for w, _ in s) for n, s in samples.items()}
        session = {n: statistics.median(t for _, t in s) for n, s in samples.items()}
        for name in variants:
            print(f"{name:8s} wall {wall[name]:.3f}s  session {session[name]:.3f}s")
        print(
            f"plugin overhead, {args.tests} tests, median of {args.repeats} "
            f"(records on / plugin off): wall {wall['records'] / wall['off']:.3f}x, "
            f"session {session['records'] / session['off']:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
