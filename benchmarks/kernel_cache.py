"""NVRTC kernel cache benchmark (CPU only: NVRTC compiles on the CPU).

Measures, side by side in one run over the kernels of benchmarks/kernels/:
  1. cold compile (miss: NVRTC + publish) vs warm hit, per kernel;
  2. capsafe's hit vs cuda.core's FileStreamProgramCache hit on the same PTX;
  3. how many compiles happen when 8 processes start cold on one empty cache.
The last line printed holds all three.

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import KERNEL_DIR, KERNELS
from capsafe import nvrtc
from capsafe.kernel_cache import KernelCache

ARCH = "sm_90"


def specs() -> list[nvrtc.KernelSpec]:
    return [nvrtc.KernelSpec(k.source(), k.file, include_paths=(str(KERNEL_DIR),)) for k in KERNELS]


def best_per_call(fn, rounds: int) -> float:
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
    the fingerprint reads the same headers capsafe's key reads, so both sides do the
    same header I/O and the ratio measures the caches themselves.
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
        for include, content in nvrtc.included_headers(
            spec.source, spec.headers, spec.include_paths, spec.name
        ):
            h.update(include.encode() + b"\0" + (content or b""))
        return make_program_cache_key(
            code=spec.source,
            code_type="c++",
            options=options[spec.name],
            target_type="ptx",
            extra_digest=h.digest(),
        )

    for spec in all_specs:
        cache[key(spec)] = images[spec.name]

    def all_hits() -> None:
        for spec in all_specs:
            data = cache.get(key(spec))
            assert data is not None

    per_hit = best_per_call(all_hits, max(1, rounds // len(all_specs))) / len(all_specs)
    cache.close()
    return per_hit, "make_program_cache_key(extra_digest=headers) + get()"


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
    print(
        f"kernel_cache: kernels={len(KERNELS)} cold={cold * 1e3:.1f}ms hit={warm * 1e6:.0f}us "
        f"hit_speedup={cold / warm:.0f}x {core_text} "
        f"cold_{args.processes}procs_compiles={counted} (kernels={len(KERNELS)}, "
        f"artifacts_valid={valid}/{args.processes * len(KERNELS)})"
    )
    return 0 if counted == reported == len(KERNELS) else 1


if __name__ == "__main__":
    sys.exit(main())
