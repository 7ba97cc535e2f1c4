"""A planted suite whose every process notes the GPU it sees, for the pinning tests.

Each test writes the CUDA_VISIBLE_DEVICES its process saw at conftest import (before
any hook could set it late) and in the test, into CAPSAFE_SWEEP_SHARED (or SEEN_DIR),
one file per pid; `seen` reads them back. `test_broken_on_gpu_1` fails on device 1 only.
"""

from __future__ import annotations

from pathlib import Path

CONFTEST = """\
import os
AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")
"""
TESTS = """\
import os
import pytest
import conftest

def _note(name):
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    folder = os.environ.get("CAPSAFE_SWEEP_SHARED") or os.environ["SEEN_DIR"]
    with open(os.path.join(folder, f"seen-{os.getpid()}.txt"), "a") as f:
        f.write(f"{name} {conftest.AT_IMPORT} {seen}\\n")
    return seen

@pytest.mark.parametrize("k", range(8))
def test_sees_one_device(k):
    _note(f"test_env.py::test_sees_one_device[{k}]")

def test_broken_on_gpu_1():
    assert _note("test_env.py::test_broken_on_gpu_1") != "1", "device 1 gives wrong results"
"""


def write_suite(root: Path) -> Path:
    root.mkdir()
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_env.py").write_text(TESTS)
    (root / "pytest.ini").write_text("[pytest]\n")
    return root


def seen(folder: Path) -> dict[int, set[tuple[str, str]]]:
    """pid -> {(device at conftest import, device in the test)}."""
    found: dict[int, set[tuple[str, str]]] = {}
    for path in folder.rglob("seen-*.txt"):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            _, at_import, in_test = line.split()
            found.setdefault(pid, set()).add((at_import, in_test))
    return found
