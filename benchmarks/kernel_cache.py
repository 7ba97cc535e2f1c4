"""NVRTC kernel cache benchmark (CPU only: NVRTC compiles on the CPU).

Measures, side by side in one run over the kernels of benchmarks/kernels/:
  1. cold compile (miss: NVRTC + publish) vs warm hit, per kernel;
  2. capsafe's hit vs cuda.core's FileStreamProgramCache hit on the same PTX;
  3. how many compiles happen when 8 processes start cold on one empty cache;
  4. what publishing one entry costs with 100 vs 10,000 entries already on disk
     (a write updates a size tracker; only eviction scans the directory).
The last line printed holds all four.

    python3 benchmarks/kernel_cache.py [--rounds 200] [--processes 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import KERNEL_DIR, KERNELS
from capsafe import nvrtc
from capsafe.kernel_cache import DEFAULT_MAX_BYTES, KernelCache, cache_key

ARCH = "sm_90"
WRITE_RATIO_LIMIT = 1.3  # a write at 10,000 entries may cost at most this much more than at 100


def specs() -> list[nvrtc.KernelSpec]:
    return [nvrtc.KernelSpec(k.source(), k.file, include_paths=(str(KERNEL_DIR),)) for k in KERNELS]


def best_per_call(fn: Callable[[], object], rounds: int) -> float:
    """Median over 5 repeats of the mean time of `rounds` calls (seconds per call)."""
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        samples.append((time.perf_counter() - start) / rounds)
    return statistics.median(samples)


def cold_vs_warm(root: Path, rounds: int) -> tuple[float, float, dict[str, bytes]]:
    cache = KernelCache(root / "capsafe")
    all_specs = specs()
    cold = 0.0
    images = {}
    for spec in all_specs:
        start = time.perf_counter()
        art = nvrtc.compile_spec(spec, arch=ARCH, cache=cache)
        cold += time.perf_counter() - start
        assert not art.cached, spec.name
        images[spec.name] = art.image
    for spec in all_specs:
        assert nvrtc.compile_spec(spec, arch=ARCH, cache=cache).cached

    def all_hits() -> None:
        for spec in all_specs:
            nvrtc.compile_spec(spec, arch=ARCH, cache=cache)

    warm = best_per_call(all_hits, max(1, rounds // len(all_specs))) / len(all_specs)
    return cold / len(all_specs), warm, images


def cuda_core_hit(root: Path, rounds: int, images: dict[str, bytes]) -> tuple[float, str]:
    """Per-hit time of cuda.core's FileStreamProgramCache on the same kernels and PTX.

    cuda.core's Program.compile(cache=...) refuses include paths, so the documented
    route is make_program_cache_key(..., extra_digest=<header fingerprint>) + get();
    the fingerprint hashes the same resolved headers capsafe's key hashes, so both
    sides do the same header I/O and the ratio measures the caches themselves.
    """
    from cuda.core import ProgramOptions
    from cuda.core.utils import FileStreamProgramCache, make_program_cache_key

    all_specs = specs()
    cache = FileStreamProgramCache(root / "cuda_core", max_size_bytes=256 * 1024 * 1024)
    options = {
        s.name: ProgramOptions(arch=ARCH, include_path=list(s.include_paths)) for s in all_specs
    }

    def key(spec: nvrtc.KernelSpec) -> bytes:
        h = hashlib.blake2b()
        for part in nvrtc.translate(spec).key_fields():
            h.update(part.encode() if isinstance(part, str) else part)
            h.update(b"\0")
        digest: bytes = make_program_cache_key(
            code=spec.source,
            code_type="c++",
            options=options[spec.name],
            target_type="ptx",
            extra_digest=h.digest(),
        )
        return digest

    for spec in all_specs:
        cache[key(spec)] = images[spec.name]

    def all_hits() -> None:
        for spec in all_specs:
            data = cache.get(key(spec))
            assert data is not None

    per_hit = best_per_call(all_hits, max(1, rounds // len(all_specs))) / len(all_specs)
    cache.close()
    return per_hit, "make_program_cache_key(extra_digest=headers) + get()"


def write_cost(root: Path, entries: int, writes: int, payload: bytes) -> float:
    """Median seconds to publish one new entry into a cache already holding `entries`."""
    cache = KernelCache(root / f"writes-{entries}", max_bytes=DEFAULT_MAX_BYTES)
    meta = {"name": "k.cu", "arch": ARCH, "nvrtc": "13.5", "log": ""}
    for n in range(entries):
        cache.get_or_compile(cache_key(["fill", str(n)]), "ptx", lambda: (payload, meta))
    samples = []
    for n in range(writes):
        key = cache_key(["timed", str(n)])
        start = time.perf_counter()
        made = cache.get_or_compile(key, "ptx", lambda: (payload, meta))
        samples.append(time.perf_counter() - start)
        assert not made.hit
    assert cache.usage()[0] == entries + writes  # under budget: nothing was evicted
    return statistics.median(samples)


def cold_processes(root: Path, processes: int) -> tuple[int, int, int]:
    """(compiles counted by the cache, compiles the workers report, valid artifacts)."""
    directory = root / "shared"
    go = root / "go"
    cmd = [sys.executable, __file__, "--worker", str(directory), "--go", str(go)]
    workers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    time.sleep(1.0)  # let every worker import and reach the start line
    go.touch()
    reports = []
    for w in workers:
        out, _ = w.communicate(timeout=600)
        if w.returncode != 0:
            raise SystemExit(f"a worker failed with exit code {w.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    digests: dict[str, set[str]] = {}
    for r in reports:
        for name, digest in r["images"].items():
            digests.setdefault(name, set()).add(digest)
    valid = sum(len(r["images"]) for r in reports if all(len(digests[n]) == 1 for n in r["images"]))
    counted = int(KernelCache(directory).stats()["compiles"])
    return counted, sum(r["compiled"] for r in reports), valid


def worker(directory: str, go: str) -> None:
    cache = KernelCache(directory)
    all_specs = specs()
    deadline = time.monotonic() + 60
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    compiled, images = 0, {}
    for spec in all_specs:
        art = nvrtc.compile_spec(spec, arch=ARCH, cache=cache)
        compiled += not art.cached
        if not art.image.lstrip().startswith(b"//") or b".entry" not in art.image:
            raise SystemExit(f"{spec.name}: not a PTX module")
        images[spec.name] = hashlib.sha256(art.image).hexdigest()
    print(json.dumps({"compiled": compiled, "images": images}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=240, help="hits timed per repeat")
    parser.add_argument("--processes", type=int, default=8, help="cold processes started at once")
    parser.add_argument("--writes", type=int, default=200, help="writes timed per cache size")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.go)
        return 0

    with tempfile.TemporaryDirectory(prefix="capsafe-bench-") as tmp:
        root = Path(tmp)
        cold, warm, images = cold_vs_warm(root, args.rounds)
        version = ".".join(map(str, nvrtc.installed_nvrtc_version()))
        print(f"{len(KERNELS)} kernels, NVRTC {version}")
        print(f"cold compile+publish: {cold * 1e3:8.2f} ms/kernel")
        print(f"capsafe warm hit:     {warm * 1e6:8.1f} us/kernel")
        try:
            core, how = cuda_core_hit(root, args.rounds, images)
            print(f"cuda.core hit:        {core * 1e6:8.1f} us/kernel ({how})")
            core_text = f"capsafe_hit/cuda.core_hit={warm / core:.2f}x ({core * 1e6:.0f} us)"
        except Exception as exc:  # report what could not be measured, measure the rest
            print(f"cuda.core FileStreamProgramCache not measured: {exc}")
            core_text = "capsafe_hit/cuda.core_hit=n/a"
        counted, reported, valid = cold_processes(root, args.processes)
        print(
            f"{args.processes} cold processes: {counted} compiles counted, {reported} reported, "
            f"{valid} valid artifacts"
        )
        payload = max(images.values(), key=len)  # the largest benchmark PTX
        small = write_cost(root, 100, args.writes, payload)
        large = write_cost(root, 10_000, args.writes, payload)
        print(
            f"write ({len(payload)} B entry): {small * 1e6:.0f} us at 100 entries, "
            f"{large * 1e6:.0f} us at 10,000"
        )
    print(
        f"kernel_cache: kernels={len(KERNELS)} cold={cold * 1e3:.1f}ms hit={warm * 1e6:.0f}us "
        f"hit_speedup={cold / warm:.0f}x {core_text} "
        f"cold_{args.processes}procs_compiles={counted} (kernels={len(KERNELS)}, "
        f"artifacts_valid={valid}/{args.processes * len(KERNELS)}) "
        f"write_100={small * 1e6:.0f}us write_10000={large * 1e6:.0f}us "
        f"write_ratio={large / small:.2f}x"
    )
    return 0 if counted == reported == len(KERNELS) and large / small <= WRITE_RATIO_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
