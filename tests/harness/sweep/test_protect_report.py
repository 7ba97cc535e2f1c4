"""`capsafe sweep --protect`: each capture-unsafe test rerun with `--capsafe-protect`, end to end.

The suite is the fake CuPy of test_integrations_protect.py over the sim backend: one
capture through CuPy's `begin_capture`/`end_capture` (the integration's hook: it survives
the neighbours with protection), one on a CuPy stream begun on the sim backend directly (no
hook sees it: it still breaks, and the report names the hazard-table rows to keep out of
its window).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_integrations_protect import CAPTURE_TEST, CONFTEST

from capsafe_harness.report import protection as protect

HOOKED = "test_fake_cupy.py::test_cupy_capture_beside_neighbours"
BYPASS = "test_fake_cupy.py::test_capture_begun_past_cupy"
BYPASS_TEST = """

def test_capture_begun_past_cupy():
    from capsafe import driver
    from capsafe.handles import CaptureMode

    capsafe.device(0)
    stream = cupy.cuda.Stream()
    driver.raw().stream_begin_capture(stream.handle, CaptureMode.RELAXED)
    hold_open()
    driver.raw().stream_end_capture(stream.handle)
"""
LEAN = ["--", "-p", "no:run-parallel", "-p", "no:hypothesispytest"]


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # no `cuda` package for cuda.core
        return False


def suite(root: Path, *, bypass: bool = True, shadow_cuda: bool = False) -> Path:
    root.mkdir()
    if shadow_cuda:  # a plain module `cuda` first on the path: cuda.core cannot be imported
        (root / "cuda.py").write_text("")
    (root / "conftest.py").write_text(CONFTEST)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (root / "test_fake_cupy.py").write_text(CAPTURE_TEST + (BYPASS_TEST if bypass else ""))
    return root


def sweep(
    tmp_path: Path, *options: str, bypass: bool = True, shadow_cuda: bool = False
) -> tuple[subprocess.CompletedProcess[str], Path, dict[str, dict[str, Any]], list[str]]:
    out = tmp_path / "out"
    root = suite(tmp_path / "s", bypass=bypass, shadow_cuda=shadow_cuda)
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", str(root),
         "--out", str(out), "--runs", "2", "--workers", "2", "--seed", "3", "--isolation-runs",
         "2", "--neighbors", "2", "--timeout", "20", "--no-progress", *options, *LEAN],
        capture_output=True, text=True, timeout=570,
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    protected = sorted(p.name for p in (out / "raw").glob("protect-*") if p.is_dir())
    return done, out, {t["nodeid"]: t for t in summary["tests"]}, protected


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_report_says_which_capture_unsafe_tests_survive_protection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done, out, tests, protected = sweep(tmp_path, "--protect", "cupy")
    assert done.returncode == 1, done.stderr
    hooked, bypass = tests[HOOKED]["capture"], tests[BYPASS]["capture"]
    assert tests[HOOKED]["classification"] == tests[BYPASS]["classification"] == "capture-unsafe"
    assert (hooked["survived"], hooked["protected_runs"], hooked["protect"]) == (True, 2, ["cupy"])
    assert (bypass["survived"], bypass["protected_failures"]) == (False, 2)
    assert hooked["protection"] == "with protection: survived 2/2 (cupy)"
    assert bypass["protection"] == (
        "still fails 2/2 with protection (cupy): not protectable by capsafe "
        "(see docs/integrations.md, hazard rows: always (ctx_sync))"
    )
    # Two batched processes for both, then the bypassing test's own alone reruns.
    assert len(protected) == 4
    gpu = {t["nodeid"]: t for t in json.loads((out / "summary.json").read_text())["gpu"][
        "capture_unsafe"]}  # fmt: skip
    assert gpu[HOOKED]["survived"] is True and gpu[BYPASS]["survived"] is False
    md = (out / "report.md").read_text()
    assert "  With protection: survived 2/2 (cupy)." in md  # the GPU section
    assert f"| `{BYPASS}` | capture-unsafe |" in md and "| still fails 2/2 with protection" in md
    page = (out / "report.html").read_text()
    assert "<p>With protection: survived 2/2 (cupy).</p>" in page
    console = done.stderr.splitlines()
    assert any(BYPASS in line and "still fails 2/2 with protection" in line for line in console)
    assert any(HOOKED in line and "with protection: survived 2/2" in line for line in console)
    assert protect.main([str(out)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "capsafe protect: 1 of 2 capture-unsafe tests pass with protection"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(installed("cupy"), reason="the planted fake CuPy stands in for an absent one")
def test_auto_protects_with_the_framework_the_captures_went_through(tmp_path: Path) -> None:
    # The fake CuPy exists only inside the suite's test processes (its conftest), and the
    # suite's own `cuda` module hides cuda.core: the suite's interpreter finds no framework,
    # but the capture observer saw the captures go through CuPy's hook point, and that is
    # what `auto` takes (the interpreter is asked only when no capture names one).
    done, _out, tests, protected = sweep(tmp_path, bypass=False, shadow_cuda=True)
    assert done.returncode == 1, done.stderr
    capture = tests[HOOKED]["capture"]
    assert (capture["survived"], capture["protect"]) == (True, ["cupy"])
    assert protected and capture["protection"].startswith("with protection: survived")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_protect_none_does_no_protected_reruns(tmp_path: Path) -> None:
    done, _, tests, protected = sweep(tmp_path, "--protect", "none", bypass=False)
    assert done.returncode == 1, done.stderr
    capture = tests[HOOKED]["capture"]
    assert (capture["survived"], capture["protected_runs"], protected) == (None, 0, [])
    assert capture["protection"] == "with protection: not rerun (--protect none)"


def test_an_unknown_protect_value_is_a_one_line_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", str(tmp_path), "--out",
         str(tmp_path / "out"), "--protect", "cupy,tensorflow"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "capsafe sweep: --protect: unknown integration 'tensorflow'; give auto, none or a "
        "comma-separated list of: cupy, cuda_core, torch"
    ]
