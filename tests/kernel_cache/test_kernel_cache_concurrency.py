"""Eight processes starting cold on one empty cache compile each kernel once (real NVRTC)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from capsafe.kernel_cache import KernelCache

KERNELS = 20
PROCESSES = 8

WORKER = textwrap.dedent(
    """
    import hashlib, json, sys, time
    from pathlib import Path
    from capsafe import nvrtc
    from capsafe.kernel_cache import KernelCache

    directory, go, index, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cache = KernelCache(directory)
    nvrtc.installed_nvrtc_version()  # load NVRTC before the start line
    deadline = time.monotonic() + 30
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    compiled, images = 0, {}
    for step in range(count):
        n = (step + index) % count  # workers start at different kernels, then collide
        source = 'extern "C" __global__ void k%d(float *x) { x[threadIdx.x] += %d.0f; }' % (n, n)
        art = nvrtc.compile(source, name="k%d.cu" % n, cache=cache)
        if (".entry k%d" % n).encode() not in art.image:
            sys.exit("k%d: not a PTX module for its kernel" % n)
        compiled += not art.cached
        images[n] = hashlib.sha256(art.image).hexdigest()
    print(json.dumps({"compiled": compiled, "images": images}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eight_cold_processes_compile_each_kernel_once(tmp_path: Path) -> None:
    directory, go = tmp_path / "cache", tmp_path / "go"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(directory), str(go), str(i), str(KERNELS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    time.sleep(0.5)
    go.touch()
    reports = []
    for worker in workers:
        out, err = worker.communicate(timeout=570)
        assert worker.returncode == 0, err
        reports.append(json.loads(out))
    assert sum(r["compiled"] for r in reports) == KERNELS
    assert KernelCache(directory).stats()["compiles"] == KERNELS
    artifacts = [(n, digest) for r in reports for n, digest in r["images"].items()]
    assert len(artifacts) == KERNELS * PROCESSES
    assert len(set(artifacts)) == KERNELS  # every process got the same bytes per kernel
    assert KernelCache(directory).usage()[0] == KERNELS
