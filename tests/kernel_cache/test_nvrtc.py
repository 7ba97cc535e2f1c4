"""capsafe.nvrtc: the cache key, real NVRTC compiles through the cache, the PTX->CUBIN loader."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from capsafe import backend_cuda, nvrtc
from capsafe.backend_cuda import NvrtcCompileError, NvrtcOutput
from capsafe.errors import CudaError, UsageError
from capsafe.handles import Device
from capsafe.kernel_cache import KernelCache, cache_key
from capsafe.nvrtc import KernelSpec, normalize_arch, spec_key

SOURCE = (
    '#include "scale.h"\nextern "C" __global__ void scale(float *x) { x[threadIdx.x] *= SCALE; }\n'
)
VERSION = (13, 5)


def key(
    spec: KernelSpec, arch: str = "sm_90", kind: str = "ptx", version: tuple[int, int] = VERSION
) -> str:
    return spec_key(spec, arch, kind, version)


def test_golden_digest_pins_the_key_format() -> None:
    spec = KernelSpec(SOURCE, "golden.cu", ("-lineinfo",), {"scale.h": "#define SCALE 2.0f\n"})
    assert key(spec) == "524eb550cbad8573638813d6b827de263775889b41e3e02aaafd732040a9192b"


def test_fields_are_length_prefixed() -> None:
    assert cache_key(["ab", "c"]) != cache_key(["a", "bc"])
    assert cache_key(["ab", ""]) != cache_key(["a", "b"])
    assert cache_key(["abc"]) == cache_key([b"abc"])


BASE = KernelSpec(SOURCE, "k.cu", ("-lineinfo",), {"scale.h": "#define SCALE 2.0f\n"})


@pytest.mark.parametrize(
    "changed",
    [
        lambda: key(dataclasses.replace(BASE, source=SOURCE + "\n")),
        lambda: key(dataclasses.replace(BASE, name="other.cu")),
        lambda: key(dataclasses.replace(BASE, options=("-lineinfo", "--use_fast_math"))),
        lambda: key(dataclasses.replace(BASE, options=())),
        lambda: key(dataclasses.replace(BASE, headers={"scale.h": "#define SCALE 3.0f\n"})),
        lambda: key(BASE, arch="sm_80"),
        lambda: key(BASE, kind="cubin"),
        lambda: key(BASE, version=(13, 6)),
    ],
    ids=[
        "source",
        "module-key",
        "option-added",
        "option-removed",
        "header-edit",
        "arch",
        "kind",
        "nvrtc-version",
    ],
)
def test_every_input_changes_the_key(changed: Callable[[], str]) -> None:
    assert changed() != key(BASE)


def test_the_key_is_stable() -> None:
    options: Any = ["-lineinfo"]  # a list where the type says tuple, as an untyped caller passes
    again = KernelSpec(SOURCE, "k.cu", options, {"scale.h": "#define SCALE 2.0f\n"})
    assert key(again) == key(BASE)


def _tree(tmp_path: Path) -> tuple[KernelSpec, Path]:
    inc = tmp_path / "inc"
    (inc / "sub").mkdir(parents=True)
    (inc / "top.cuh").write_text('#include "sub/mid.cuh"\n')
    (inc / "sub" / "mid.cuh").write_text('#include "leaf.cuh"\n#define MID 1\n')  # beside mid
    (inc / "sub" / "leaf.cuh").write_text("#define LEAF 1\n")
    (inc / "angle.cuh").write_text("#define ANGLE 1\n")
    (inc / "unused.cuh").write_text("#define UNUSED 1\n")
    source = '#include "top.cuh"\n#  include <angle.cuh>\n#include <cuda_fp16.h>\n'
    return KernelSpec(source, "t.cu", include_paths=(str(inc),)), inc


@pytest.mark.parametrize("header", ["top.cuh", "sub/mid.cuh", "sub/leaf.cuh", "angle.cuh"])
def test_editing_any_reachable_header_changes_the_key(tmp_path: Path, header: str) -> None:
    spec, inc = _tree(tmp_path)
    before = key(spec)
    (inc / header).write_text((inc / header).read_text() + "// edited\n")
    assert key(spec) != before


def test_unreachable_files_do_not_change_the_key(tmp_path: Path) -> None:
    spec, inc = _tree(tmp_path)
    before = key(spec)
    (inc / "unused.cuh").write_text("#define UNUSED 2\n")
    assert key(spec) == before


def test_a_missing_header_that_appears_changes_the_key(tmp_path: Path) -> None:
    spec, inc = _tree(tmp_path)
    assert str(inc / "cuda_fp16.h") in nvrtc.translate(spec).missing  # recorded, not an error
    before = key(spec)
    (inc / "cuda_fp16.h").write_text("// a local shadow\n")
    assert key(spec) != before


def test_include_cycles_terminate() -> None:
    headers = {"a.h": '#include "b.h"\n', "b.h": '#include "a.h"\n'}
    unit = nvrtc.translate(KernelSpec('#include "a.h"\n', "k.cu", headers=headers))
    assert unit.nvrtc_headers() == headers  # each once, as given: they name in-memory headers


@pytest.mark.parametrize(
    ("given", "kind", "expected"),
    [
        ("sm_90", "ptx", "sm_90"),
        ("compute_90", "ptx", "compute_90"),
        ("compute_90", "cubin", "sm_90"),
        ("90", "ptx", "sm_90"),
        (90, "ptx", "sm_90"),
        ((8, 6), "cubin", "sm_86"),
        ("SM_90a", "cubin", "sm_90a"),
    ],
)
def test_normalize_arch(given: str | int | tuple[int, int], kind: str, expected: str) -> None:
    assert normalize_arch(given, kind) == expected


@pytest.mark.parametrize("bad", ["hopper", "sm_9", "sm90"])
def test_bad_arch_is_a_usage_error(bad: str) -> None:
    with pytest.raises(UsageError, match="arch"):
        normalize_arch(bad)


@pytest.mark.parametrize(
    "option",
    [
        "-arch=sm_80",
        "--gpu-architecture=sm_80",
        "-I/tmp",
        "--include-path=/tmp",
        "--pre-include=x.h",
    ],
)
def test_options_the_key_cannot_see_are_refused(option: str) -> None:
    with pytest.raises(UsageError, match="not allowed"):
        KernelSpec(SOURCE, options=(option,))


# -- real NVRTC ------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> KernelCache:
    return KernelCache(tmp_path / "cache")


def test_compile_goes_through_the_cache_and_header_edits_recompile(cache: KernelCache) -> None:
    headers = {"scale.h": "#define SCALE 2.0f\n"}
    first = nvrtc.compile(SOURCE, name="scale.cu", headers=headers, cache=cache)
    again = nvrtc.compile(SOURCE, name="scale.cu", headers=headers, cache=cache)
    assert b".entry scale" in first.image and first.kind == "ptx" and first.arch == "sm_90"
    assert (first.cached, again.cached, again.image) == (False, True, first.image)
    edited = nvrtc.compile(
        SOURCE, name="scale.cu", headers={"scale.h": "#define SCALE 3.0f\n"}, cache=cache
    )
    assert not edited.cached and edited.image != first.image


def test_cubin_is_an_elf_image(cache: KernelCache) -> None:
    art = nvrtc.compile(
        SOURCE,
        headers={"scale.h": "#define SCALE 2.0f\n"},
        kind="cubin",
        arch="compute_90",
        cache=cache,
    )
    assert art.image[:4] == b"\x7fELF" and art.arch == "sm_90"


def test_compile_errors_carry_nvrtc_log_and_cache_nothing(cache: KernelCache) -> None:
    with pytest.raises(NvrtcCompileError) as info:
        nvrtc.compile(
            'extern "C" __global__ void k() { undefined_thing(); }', name="bad.cu", cache=cache
        )
    assert "undefined_thing" in info.value.log and "bad.cu" in str(info.value)
    assert cache.usage() == (0, 0)


# The check runs in its own process: on the old code the compile corrupted the process it ran in.
ONE_BYTE_OBJECTS_AFTER_A_COMPILE = """
from capsafe import backend_cuda
kernel = 'extern "C" __global__ void k(int *p) { *p = 1; }'
out = backend_cuda.nvrtc_compile(kernel, "k.cu", ["--gpu-architecture=sm_90"], {}, "ptx")
space = b"a "[1:]  # the interpreter's shared one-byte object for 0x20
print(repr(out.log), space[0], repr(b" ".strip()))
"""


def test_a_compile_leaves_the_interpreters_shared_bytes_alone() -> None:
    # NVRTC writes its log (one NUL when empty) into the buffer it is handed; handed
    # b" " * 1, which is the interpreter's shared b" ", it made every b" " a b"\0" and
    # a lexer that strips spaces stopped seeing `/* c */ #include` (found by sweeping the tests).
    done = subprocess.run(
        [sys.executable, "-c", ONE_BYTE_OBJECTS_AFTER_A_COMPILE],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["''", "32", "b''"]


# -- loading ---------------------------------------------------------------------


class FakeBackend:
    """Just what the loader touches: attributes and module_load_data."""

    def __init__(self, refuse: str | None) -> None:
        self.refuse = refuse
        self.loaded: list[bytes] = []

    def device_get_attribute(self, device: Device, attribute: str) -> int:
        return {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0}[attribute]

    def module_load_data(self, image: bytes) -> int:
        if self.refuse and not image.startswith(b"\x7fELF"):
            raise CudaError(self.refuse, "cuModuleLoadData")
        self.loaded.append(image)
        return len(self.loaded)


def fake_compiler(calls: list[str]) -> Callable[..., NvrtcOutput]:
    def compile(
        source: str, name: str, options: Sequence[str], headers: Mapping[str, str], kind: str
    ) -> NvrtcOutput:
        calls.append(kind)
        return NvrtcOutput(b"\x7fELF cubin" if kind == "cubin" else b".version 9.5\n", "")

    return compile


def _load(backend: Any, cache: KernelCache, calls: list[str]) -> nvrtc.LoadedModule:
    """`backend`: a FakeBackend, standing in for the two methods of a Backend the loader calls."""
    spec = KernelSpec(SOURCE, headers={"scale.h": "#define SCALE 2.0f\n"})
    artifact = nvrtc.compile_spec(
        spec,
        arch=nvrtc.device_arch(backend, Device(0)),
        cache=cache,
        compiler=fake_compiler(calls),
        nvrtc_version=VERSION,
    )
    return nvrtc.load_artifact(artifact, spec, backend, cache=cache)


@pytest.mark.parametrize("result", sorted(nvrtc.PTX_REFUSED))
def test_refused_ptx_falls_back_to_a_cached_cubin(
    cache: KernelCache, result: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(backend_cuda, "nvrtc_compile", fake_compiler(calls))  # nvrtc calls it there
    monkeypatch.setattr(nvrtc, "installed_nvrtc_version", lambda: VERSION)
    loaded = _load(FakeBackend(result), cache, calls)
    assert loaded.refused is not None
    assert loaded.refused.result == result and loaded.artifact.kind == "cubin"
    assert loaded.artifact.arch == "sm_90" and calls == ["ptx", "cubin"]
    again = _load(FakeBackend(result), cache, calls)
    assert again.artifact.cached and calls == ["ptx", "cubin"]  # both hit the cache now


def test_accepted_ptx_loads_as_is(cache: KernelCache) -> None:
    calls: list[str] = []
    loaded = _load(FakeBackend(None), cache, calls)
    assert loaded.refused is None and loaded.artifact.kind == "ptx" and calls == ["ptx"]


def test_other_load_errors_propagate(cache: KernelCache) -> None:
    with pytest.raises(CudaError, match="OUT_OF_MEMORY"):
        _load(FakeBackend("CUDA_ERROR_OUT_OF_MEMORY"), cache, [])


def test_sim_driver_refuses_new_ptx_and_loads_the_cubin(cache: KernelCache) -> None:
    from capsafe.sim import SimBackend

    backend = SimBackend()
    backend.init()
    device = backend.device_get(0)
    backend.ctx_set_current(backend.primary_ctx_retain(device))
    spec = KernelSpec('extern "C" __global__ void fill(float *x) { x[0] = 1.0f; }', "fill.cu")
    ptx = nvrtc.compile_spec(spec, arch=nvrtc.device_arch(backend, device), cache=cache)
    # Newer than any driver, whichever NVRTC is installed (13.0's PTX is one the sim takes).
    image = re.sub(rb"^\.version \d+\.\d+", b".version 99.9", ptx.image, count=1, flags=re.M)
    newest = dataclasses.replace(ptx, image=image)
    loaded = nvrtc.load_artifact(newest, spec, backend, cache=cache)
    assert loaded.refused is not None
    assert loaded.refused.result == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
    assert loaded.artifact.kind == "cubin" and not loaded.artifact.cached
    assert backend.module_get_function(loaded.module, "fill").name == "fill"
    warm = nvrtc.load_artifact(newest, spec, backend, cache=cache)
    assert warm.artifact.cached and warm.artifact.image == loaded.artifact.image
    backend.module_unload(loaded.module)
    backend.module_unload(warm.module)
    backend.primary_ctx_release(device)


@pytest.mark.cuda
def test_real_driver_loads_and_launches_from_cold_and_warm(cache: KernelCache) -> None:
    import ctypes

    from capsafe.driver import create_backend

    backend, _ = create_backend("cuda")
    backend.init()
    device = backend.device_get(0)
    backend.ctx_set_current(backend.primary_ctx_retain(device))
    spec = KernelSpec(
        'extern "C" __global__ void iota(int *x, int k) { x[threadIdx.x] = threadIdx.x * k; }',
        "iota.cu",
    )
    stream = backend.stream_create(nonblocking=True)
    outputs = []
    for _ in range(2):  # cold, then warm
        loaded = nvrtc.load(spec, backend, device, cache=cache)
        ptr = backend.mem_alloc(4 * 64)
        function = backend.module_get_function(loaded.module, "iota")
        backend.launch_kernel(function, (1, 1, 1), (64, 1, 1), [ptr, ctypes.c_int(3)], stream)
        host = bytearray(4 * 64)
        backend.memcpy_dtoh_async(host, ptr, stream)
        backend.stream_synchronize(stream)
        backend.mem_free(ptr)
        backend.module_unload(loaded.module)
        outputs.append((loaded.artifact.cached, bytes(host)))
    assert [cached for cached, _ in outputs] == [False, True]
    assert outputs[0][1] == outputs[1][1]
    assert list(memoryview(outputs[0][1]).cast("i")) == [3 * i for i in range(64)]
    backend.stream_destroy(stream)
