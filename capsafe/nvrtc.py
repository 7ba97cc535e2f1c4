"""Compile CUDA C++ with NVRTC through the kernel disk cache, and load it on a device.

PTX is the default artifact: one PTX serves every newer GPU and the driver keeps
its own PTX->SASS cache. When the driver refuses a PTX (NVRTC newer than the
driver: CUDA_ERROR_UNSUPPORTED_PTX_VERSION), `load` compiles a CUBIN for the
device's own architecture, caches that too, and loads it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from capsafe import _state, backend_cuda
from capsafe.backend import Backend
from capsafe.errors import CudaError, UsageError
from capsafe.handles import Device, Module
from capsafe.kernel_cache import KINDS as CACHE_KINDS
from capsafe.kernel_cache import KernelCache, OnceWarner, cache_key, default_cache, includes

DEFAULT_ARCH = "sm_90"  # the H200's; `load` always passes the device's own
KINDS = tuple(CACHE_KINDS)  # ("ptx", "cubin"): the artifacts the cache can hold
# Results with which a driver turns a PTX image away; a CUBIN for the device may still load.
PTX_REFUSED = frozenset(
    {
        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        "CUDA_ERROR_INVALID_PTX",
        "CUDA_ERROR_INVALID_IMAGE",
        "CUDA_ERROR_NO_BINARY_FOR_GPU",
    }
)
# Options that pull in files the key cannot see, or that the arch/include_paths arguments own.
_RESERVED_OPTIONS = (
    "-arch",
    "--gpu-architecture",
    "-I",
    "--include-path",
    "--pre-include",
    "-include",
)
# Options with which NVRTC reads or writes precompiled headers: files outside the key.
_PCH_OPTIONS = frozenset(
    f"{dashes}{name}"
    for dashes in ("-", "--")
    for name in (
        "pch",
        "create-pch",
        "use-pch",
        "pch-dir",
        "pch-verbose",
        "pch-messages",
        "instantiate-templates-in-pch",
    )
)
_ARCH = re.compile(r"^(sm|compute)_(\d{2,3}[af]?)$")

log = logging.getLogger("capsafe.nvrtc")
UNCACHED_WARNER = OnceWarner("; compiling it without the cache")
_state.on_fork(lambda: UNCACHED_WARNER.reset_after_fork())
Compiler = Callable[[str, str, Sequence[str], Mapping[str, str], str], backend_cuda.NvrtcOutput]


@dataclass(frozen=True)
class KernelSpec:
    """Everything that decides what NVRTC produces, except the target arch and kind.

    `name` is the module key: NVRTC's program name, shown in its messages.
    `headers` maps include names to in-memory contents; `include_paths` are
    searched for the rest, the way NVRTC searches (kernel_cache.includes).
    """

    source: str
    name: str = "kernel.cu"
    options: tuple[str, ...] = ()
    headers: Mapping[str, str] = field(default_factory=dict)
    include_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "include_paths", tuple(os.fspath(p) for p in self.include_paths))
        for option in self.options:
            if option.split("=", 1)[0] in _RESERVED_OPTIONS or option.startswith("-I"):
                raise UsageError(
                    f"option {option!r} is not allowed here: pass arch= and include_paths= "
                    "instead, so the cache key sees every input"
                )


@dataclass(frozen=True)
class Artifact:
    """A compiled module image and where it came from."""

    image: bytes = field(repr=False)
    kind: str
    arch: str
    name: str
    key: str
    log: str
    cached: bool  # served from the disk cache
    compile_seconds: float  # what compiling it cost, now or when it was cached


@dataclass(frozen=True)
class LoadedModule:
    module: Module
    artifact: Artifact  # the image that loaded (the CUBIN when the PTX was refused)
    refused: CudaError | None = None  # the driver's refusal of the PTX, when it happened


def normalize_arch(arch: str | int | tuple[int, int], kind: str = "ptx") -> str:
    """'sm_90' from 'sm_90', 'compute_90', '90', 90 or (9, 0); a CUBIN needs a real sm_."""
    if isinstance(arch, tuple):
        text = f"sm_{arch[0]}{arch[1]}"
    else:
        text = str(arch).strip().lower()
        if text.isdigit():
            text = f"sm_{text}"
    match = _ARCH.match(text)
    if match is None:
        raise UsageError(f"arch {arch!r} is not an architecture like 'sm_90' or 'compute_90'")
    if kind == "cubin" and match.group(1) == "compute":
        text = f"sm_{match.group(2)}"
    return text


@functools.cache
def installed_nvrtc_version() -> tuple[int, int]:
    """The NVRTC version, asked once per process (it is part of every key)."""
    return backend_cuda.nvrtc_version()


def uncacheable_reason(spec: KernelSpec) -> str | None:
    """Why `spec` cannot be cached whatever its sources say, or None."""
    for option in spec.options:
        if option.split("=", 1)[0] in _PCH_OPTIONS:
            return f"option {option!r} makes NVRTC read or write precompiled headers"
    return None


def translate(spec: KernelSpec) -> includes.Translation:
    """What NVRTC will compile for `spec`; includes.Unfollowable when that cannot be known."""
    reason = uncacheable_reason(spec)
    if reason is not None:
        raise includes.Unfollowable(reason)
    return includes.resolve(spec.source, spec.name, spec.headers, spec.include_paths)


def spec_key(
    spec: KernelSpec,
    arch: str,
    kind: str,
    nvrtc_version: tuple[int, int],
    translation: includes.Translation | None = None,
) -> str:
    """The cache key: exactly what NVRTC is handed, plus arch, options, kind and version."""
    unit = translate(spec) if translation is None else translation
    fields: list[bytes | str] = ["module", spec.name, *unit.key_fields()]
    fields += ["arch", arch, f"options:{len(spec.options)}", *spec.options, "kind", kind]
    fields += ["nvrtc", "{}.{}".format(*nvrtc_version)]
    return cache_key(fields)


def nvrtc_options(spec: KernelSpec, arch: str) -> list[str]:
    """The command line for compiling `spec` as given (uncached): arch, -I paths, options."""
    return [
        f"--gpu-architecture={arch}",
        *(f"--include-path={p}" for p in spec.include_paths),
        *spec.options,
    ]


def compile_spec(
    spec: KernelSpec,
    *,
    arch: str | int | tuple[int, int] = DEFAULT_ARCH,
    kind: str = "ptx",
    cache: KernelCache | None = None,
    compiler: Compiler | None = None,
    nvrtc_version: tuple[int, int] | None = None,
) -> Artifact:
    """Compile `spec` to `kind` for `arch`, through the cache.

    Raises backend_cuda.NvrtcCompileError (with NVRTC's log) when the source is bad.
    Sources the key cannot follow (kernel_cache.includes.Unfollowable, PCH options)
    compile as given without the cache (key ""), with one warning per process.
    `compiler` and `nvrtc_version` default to the installed NVRTC.
    """
    if kind not in KINDS:
        raise UsageError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    arch = normalize_arch(arch, kind)
    version = nvrtc_version or installed_nvrtc_version()
    run = compiler or backend_cuda.nvrtc_compile
    try:
        unit = translate(spec)
    except includes.Unfollowable as exc:
        UNCACHED_WARNER(f"{spec.name}: {exc}")
        start = time.perf_counter()
        out = run(spec.source, spec.name, nvrtc_options(spec, arch), dict(spec.headers), kind)
        seconds = time.perf_counter() - start
        return Artifact(out.image, kind, arch, spec.name, "", out.log, False, seconds)
    key = spec_key(spec, arch, kind, version, unit)

    def build() -> tuple[bytes, dict[str, str]]:
        # No -I paths: every header NVRTC can reach is in memory, named as resolved.
        out = run(
            unit.nvrtc_source(),
            spec.name,
            [f"--gpu-architecture={arch}", *spec.options],
            unit.nvrtc_headers(),
            kind,
        )
        meta = {"name": spec.name, "arch": arch, "nvrtc": "{}.{}".format(*version), "log": out.log}
        return out.image, meta

    chosen = default_cache() if cache is None else cache
    got = chosen.get_or_compile(key, kind, build, publish_if=unit.still_valid)
    return Artifact(
        got.payload,
        kind,
        arch,
        spec.name,
        key,
        str(got.meta.get("log", "")),
        got.hit,
        got.compile_seconds,
    )


def compile(
    source: str,
    *,
    name: str = "kernel.cu",
    arch: str | int | tuple[int, int] = DEFAULT_ARCH,
    options: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
    include_paths: Sequence[str | os.PathLike[str]] = (),
    kind: str = "ptx",
    cache: KernelCache | None = None,
) -> Artifact:
    """Compile CUDA C++ `source` to PTX or CUBIN with NVRTC, through the disk cache."""
    spec = KernelSpec(
        source,
        name,
        tuple(options),
        dict(headers or {}),
        tuple(str(os.fspath(p)) for p in include_paths),
    )
    return compile_spec(spec, arch=arch, kind=kind, cache=cache)


def device_arch(backend: Backend, device: Device) -> str:
    """'sm_XY' from the device's compute capability."""
    major = backend.device_get_attribute(device, "COMPUTE_CAPABILITY_MAJOR")
    minor = backend.device_get_attribute(device, "COMPUTE_CAPABILITY_MINOR")
    return f"sm_{major}{minor}"


def load(
    spec: KernelSpec,
    backend: Backend,
    device: Device,
    *,
    kind: str = "ptx",
    cache: KernelCache | None = None,
) -> LoadedModule:
    """Compile `spec` for `device` and load it into the current context."""
    artifact = compile_spec(spec, arch=device_arch(backend, device), kind=kind, cache=cache)
    return load_artifact(artifact, spec, backend, cache=cache)


def load_artifact(
    artifact: Artifact, spec: KernelSpec, backend: Backend, *, cache: KernelCache | None = None
) -> LoadedModule:
    """Load `artifact`; when the driver refuses its PTX, compile, cache and load a CUBIN."""
    try:
        return LoadedModule(backend.module_load_data(artifact.image), artifact)
    except CudaError as exc:
        if artifact.kind != "ptx" or exc.result not in PTX_REFUSED:
            raise
        refused = exc
    log.info(
        "the driver refused the PTX of %s (%s); loading a CUBIN for %s instead",
        artifact.name,
        refused.result,
        artifact.arch,
    )
    cubin = compile_spec(spec, arch=artifact.arch, kind="cubin", cache=cache)
    return LoadedModule(backend.module_load_data(cubin.image), cubin, refused)
