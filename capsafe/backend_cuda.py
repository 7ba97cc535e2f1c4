"""The real driver (and NVRTC) through cuda.bindings.

This is the only module in the project that imports cuda.bindings. Everything
else talks to `capsafe.backend.Backend` (driver) or to the NVRTC functions at
the bottom of this file, so a driver or bindings upgrade touches one file.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from capsafe.errors import CapsafeError

# ---------------------------------------------------------------------------
# NVRTC: runs on the CPU (the nvidia-cuda-nvrtc wheel); no GPU or driver needed.
# ---------------------------------------------------------------------------


class NvrtcUnavailable(CapsafeError, RuntimeError):
    """cuda-bindings or the NVRTC library is not installed."""


class NvrtcCompileError(CapsafeError, RuntimeError):
    """NVRTC rejected the source; `log` is NVRTC's own compile log."""

    def __init__(self, name: str, result: str, log: str) -> None:
        self.name, self.result, self.log = name, result, log
        super().__init__(f"NVRTC could not compile {name}: {result}\n{log}".rstrip())


@dataclass(frozen=True)
class NvrtcOutput:
    image: bytes  # PTX text (NUL-terminated, as NVRTC returns it) or a CUBIN
    log: str


@functools.cache
def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise NvrtcUnavailable(
            f"NVRTC needs cuda-bindings and nvidia-cuda-nvrtc ({exc}); "
            "install them with: pip install 'capsafe[cuda]'"
        ) from exc
    return nvrtc


def _nvrtc_check(result, call: str) -> None:
    if int(result) != 0:
        raise NvrtcUnavailable(f"{call} failed: {result.name}")


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that will compile."""
    nvrtc = _nvrtc()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the library itself failed to load
        raise NvrtcUnavailable(f"the NVRTC library could not be loaded: {exc}") from exc
    _nvrtc_check(err, "nvrtcVersion")
    return major, minor


def nvrtc_compile(
    source: str,
    name: str,
    options: Sequence[str],
    headers: Mapping[str, str],
    kind: str,
) -> NvrtcOutput:
    """Compile one translation unit to `kind` ("ptx" or "cubin")."""
    nvrtc = _nvrtc()
    names = [h.encode() for h in headers]
    bodies = [headers[h].encode() for h in headers]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), len(names), bodies, names)
    _nvrtc_check(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _nvrtc_check(err, "nvrtcGetProgramLogSize")
        log = b" " * size
        (err,) = nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.rstrip(b"\0").decode(errors="replace").strip()
        if int(result) != 0:
            raise NvrtcCompileError(name, result.name, log_text)
        if kind == "ptx":
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            _nvrtc_check(err, "nvrtcGetPTXSize")
            image = b" " * size
            (err,) = nvrtc.nvrtcGetPTX(prog, image)
            _nvrtc_check(err, "nvrtcGetPTX")
        elif kind == "cubin":
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            _nvrtc_check(err, "nvrtcGetCUBINSize")
            image = b" " * size
            (err,) = nvrtc.nvrtcGetCUBIN(prog, image)
            _nvrtc_check(err, "nvrtcGetCUBIN")
        else:
            raise ValueError(f"kind must be 'ptx' or 'cubin', not {kind!r}")
        return NvrtcOutput(image=bytes(image), log=log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
