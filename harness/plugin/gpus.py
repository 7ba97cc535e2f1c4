"""GPU pinning: which one device each test process sees, through CUDA_VISIBLE_DEVICES.

`--gpus` (the sweep) and `--capsafe-gpus` (the plugin) take `all`, a count `N` (the
first N of `all`) or a list of device ids `0,2,5` (one device: `2,`). `all` is what
this machine shows without initialising CUDA: the entries of CUDA_VISIBLE_DEVICES when
it is set, else the devices `nvidia-smi -L` lists. A list is taken as given, even where
no GPU exists (it only sets a variable; a process pinned to an absent device sees none,
and says so).

Each xdist worker `gwK` gets entry K mod n, a single process (`main`) the first entry.
The sweep hands every single process (isolation rerun, replay) one entry round-robin,
so with the seeded xdist split every assignment follows from the seed.

Stdlib only: the plugin imports this module in every test process.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

VISIBLE = "CUDA_VISIBLE_DEVICES"
WORKER_ENV = "PYTEST_XDIST_WORKER"  # set by xdist in a worker before its config exists
_SMI_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


class GpuError(ValueError):
    """A GPU spec that cannot be honoured here: a one-line reason for the user."""


def add_option(group: Any) -> None:
    group.addoption(
        "--capsafe-gpus",
        metavar="all|N|ID,ID...",
        help="pin each xdist worker (or this process) to one GPU through CUDA_VISIBLE_DEVICES, "
        "round-robin over the devices named (all: every visible one; N: the first N); "
        "recorded per row as `gpu`",
    )


def as_spec(devices: Sequence[str]) -> str:
    """`devices` as a spec `parse` reads back as these ids (one device: `2,`, never a count)."""
    return ",".join(devices) + ("," if len(devices) == 1 else "")


def smi_devices(text: str) -> list[str]:
    """Device indices in `nvidia-smi -L` output."""
    return _SMI_LINE.findall(text)


def detect() -> list[str]:
    """The devices this process may use, without initialising CUDA (see the module doc)."""
    visible = os.environ.get(VISIBLE)
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return smi_devices(done.stdout) if done.returncode == 0 else []


def parse(spec: str, detected: Callable[[], list[str]] = detect) -> tuple[str, ...]:
    """The device ids `spec` names; GpuError when it cannot be honoured."""
    spec = spec.strip()
    if spec == "all" or spec.isdigit():
        found = detected()
        if not found:
            raise GpuError(
                f"{spec}: no GPU found (CUDA_VISIBLE_DEVICES and nvidia-smi -L show none)"
            )
        if spec == "all":
            return tuple(found)
        count = int(spec)
        if not 1 <= count <= len(found):
            raise GpuError(f"{spec}: a count must be 1 to {len(found)} (the GPUs found: "
                           f"{','.join(found)}); one device by id: {spec},")  # fmt: skip
        return tuple(found[:count])
    ids = [d.strip() for d in spec.removesuffix(",").split(",")]
    if not spec or any(not d for d in ids):
        raise GpuError(f"{spec!r}: give all, a count or device ids like 0,2,5")
    if len(set(ids)) != len(ids):
        raise GpuError(f"{spec}: a device is named twice")
    return tuple(ids)


def for_worker(gpus: Sequence[str], worker: str) -> str:
    """The device of xdist worker `gwK` (K mod n), or of a process without xdist (the first)."""
    if worker.startswith("gw") and worker[2:].isdigit():
        return gpus[int(worker[2:]) % len(gpus)]
    return gpus[0]


def pin_this_process(spec: str, *, spawns_workers: bool) -> tuple[str, ...]:
    """The devices `spec` names; sets CUDA_VISIBLE_DEVICES to this process's one (before
    CUDA is initialised), except in an xdist controller: it runs no test, and its workers
    must inherit the environment `all` is read from."""
    gpus = parse(spec)
    worker = os.environ.get(WORKER_ENV)
    if worker is not None or not spawns_workers:
        os.environ[VISIBLE] = for_worker(gpus, worker or "main")
    return gpus
