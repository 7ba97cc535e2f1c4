"""Load and launch every benchmark kernel from the cold path and from a warm cache (GPU).

For each kernel of benchmarks/kernels/: compile with the cache disabled (cold),
then through an empty cache (publishes) and again (must hit), load both on the
device with capsafe.nvrtc.load (PTX first; CUBIN when the driver refuses the
PTX), launch each on identical inputs and compare every buffer byte for byte.
Then force the PTX-refused fallback for real: rewrite a PTX's `.version` to one
no driver supports, load it with load_artifact and check the CUBIN it falls
back to gives the same bytes. Prints what happened per kernel and one line last.

    PYTHONPATH=$PWD CAPSAFE_BACKEND=cuda python3 benchmarks/kernel_cache_gpu.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import KERNEL_DIR, KERNELS, Buffer, Kernel
from capsafe import driver, nvrtc
from capsafe.backend import Backend, KernelArg
from capsafe.handles import DevicePtr, Stream
from capsafe.kernel_cache import KernelCache


def run_kernel(backend: Backend, stream: Stream, loaded: nvrtc.LoadedModule, k: Kernel) -> bytes:
    """Launch `k` on fresh buffers filled from fixed seeds; all buffers' bytes afterwards."""
    function = backend.module_get_function(loaded.module, k.entry)
    buffers: list[tuple[DevicePtr, int]] = []
    args: list[KernelArg] = []
    for i, arg in enumerate(k.args):
        if isinstance(arg, Buffer):
            ptr = backend.mem_alloc(arg.nbytes)
            backend.memcpy_htod_async(ptr, arg.contents(seed=i), stream)
            buffers.append((ptr, arg.nbytes))
            args.append(ptr)
        else:
            args.append(arg)
    backend.launch_kernel(function, k.grid, k.block, args, stream, k.shared_mem)
    out = []
    for ptr, nbytes in buffers:
        host = bytearray(nbytes)
        backend.memcpy_dtoh_async(host, ptr, stream)
        out.append(host)
    backend.stream_synchronize(stream)
    for ptr, _ in buffers:
        backend.mem_free(ptr)
    return b"".join(bytes(h) for h in out)


def how(loaded: nvrtc.LoadedModule) -> str:
    if loaded.refused is None:
        return loaded.artifact.kind
    return f"{loaded.artifact.kind} (PTX refused: {loaded.refused.result})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="cache directory to use (default: a fresh temporary one)")
    args = parser.parse_args()
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="capsafe-gpu-cache-")
    directory = Path(args.dir) if tmp is None else Path(tmp.name)

    backend = driver.get()
    device = backend.device_get(0)
    backend.ctx_set_current(backend.primary_ctx_retain(device))
    stream = backend.stream_create(nonblocking=True)
    arch = nvrtc.device_arch(backend, device)
    print(
        f"backend {backend.name}: {backend.device_get_name(device)} ({arch}), driver "
        f"{backend.driver_version()}, NVRTC {'.'.join(map(str, nvrtc.installed_nvrtc_version()))}"
        f", cache {directory}"
    )

    cold_cache = KernelCache(directory / "unused", enabled=False)
    warm_cache = KernelCache(directory)
    failures, fallbacks, cold_s, warm_s = 0, 0, 0.0, 0.0
    for k in KERNELS:
        spec = nvrtc.KernelSpec(k.source(), k.file, include_paths=(str(KERNEL_DIR),))
        start = time.perf_counter()
        cold = nvrtc.load(spec, backend, device, cache=cold_cache)
        cold_s += time.perf_counter() - start
        nvrtc.load(spec, backend, device, cache=warm_cache)  # publishes PTX (and CUBIN)
        start = time.perf_counter()
        warm = nvrtc.load(spec, backend, device, cache=warm_cache)
        warm_s += time.perf_counter() - start
        same = run_kernel(backend, stream, cold, k) == run_kernel(backend, stream, warm, k)
        ok = same and warm.artifact.cached and not cold.artifact.cached
        failures += not ok
        fallbacks += warm.refused is not None
        print(
            f"{'ok  ' if ok else 'FAIL'} {k.file:24} cold: {how(cold):50} warm: {how(warm)}"
            f"{'' if warm.artifact.cached else ' (NOT a cache hit)'}"
            f"{'' if same else ' OUTPUTS DIFFER'}"
        )
        for loaded in (cold, warm):
            backend.module_unload(loaded.module)

    # Force the fallback: a PTX whose .version no driver supports.
    k = KERNELS[0]
    spec = nvrtc.KernelSpec(k.source(), k.file, include_paths=(str(KERNEL_DIR),))
    ptx = nvrtc.compile_spec(spec, arch=arch, kind="ptx", cache=warm_cache)
    newest = re.sub(rb"^\.version \d+\.\d+", b".version 99.9", ptx.image, count=1, flags=re.M)
    forced = nvrtc.load_artifact(
        dataclasses.replace(ptx, image=newest), spec, backend, cache=warm_cache
    )
    reference = nvrtc.load(spec, backend, device, cache=cold_cache)
    forced_ok = (
        forced.refused is not None
        and forced.artifact.kind == "cubin"
        and (run_kernel(backend, stream, forced, k) == run_kernel(backend, stream, reference, k))
    )
    print(
        f"{'ok  ' if forced_ok else 'FAIL'} forced '.version 99.9' PTX of {k.file}: "
        f"{how(forced)}; output identical to the cold path: {forced_ok}"
    )
    backend.module_unload(forced.module)
    backend.module_unload(reference.module)
    backend.stream_destroy(stream)
    if tmp is not None:
        tmp.cleanup()

    print(
        f"kernel_cache_gpu: backend={backend.name} arch={arch} kernels={len(KERNELS)} "
        f"identical={len(KERNELS) - failures}/{len(KERNELS)} ptx_refused_fallbacks={fallbacks} "
        f"forced_fallback={'ok' if forced_ok else 'FAILED'} "
        f"cold_load={cold_s / len(KERNELS) * 1e3:.1f}ms "
        f"warm_load={warm_s / len(KERNELS) * 1e3:.2f}ms "
        f"ratio={cold_s / warm_s:.0f}x"
    )
    return 0 if failures == 0 and forced_ok else 1


if __name__ == "__main__":
    sys.exit(main())
