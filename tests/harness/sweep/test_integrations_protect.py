"""`--capsafe-protect`, lazy framework imports, and method replacement on extension types."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from capsafe.integrations import _patch
from capsafe_harness.report import protection as protect

pytest_plugins = ["pytester"]
FAKES = Path(__file__).resolve().parents[2] / "core" / "test_integrations_cupy.py"
SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"

# Loads the fake CuPy of test_integrations_cupy.py as `cupy`, over the process-wide sim driver.
CONFTEST = f"""
import importlib.util, os, sys
os.environ["CAPSAFE_BACKEND"] = "sim"
from capsafe import driver
spec = importlib.util.spec_from_file_location("fakes", {str(FAKES)!r})
fakes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fakes)
sys.modules["cupy"] = fakes.fake_cupy(driver.raw())
"""

CAPTURE_TEST = """
import capsafe, cupy
from capsafe_repro.window import hold_open

def test_cupy_capture_beside_neighbours():
    capsafe.device(0)
    stream = cupy.cuda.Stream()
    stream.begin_capture()
    hold_open()  # until the neighbours' calls met the capture, however slow the machine
    stream.end_capture()
"""


@pytest.fixture
def run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., pytest.RunResult]:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("CAPSAFE_BACKEND", "sim")

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest_subprocess(
            "-p", "capsafe_harness.plugin", "-p", "no:cacheprovider", *args
        )

    return run


def usage_error(result: pytest.RunResult) -> str:
    """The one line pytest printed for a usage error (and no traceback)."""
    lines = [line for line in result.errlines if line.strip()]
    assert "Traceback" not in result.stderr.str()
    assert len(lines) == 1, lines
    return lines[0]


def test_unknown_name_is_a_one_line_usage_error(run: Callable[..., pytest.RunResult]) -> None:
    result = run("--capsafe-protect=cupy,tensorflow")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert usage_error(result) == (
        "ERROR: --capsafe-protect: unknown integration 'tensorflow'; "
        "give a comma-separated list of: cupy, cuda_core, torch"
    )


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_a_framework_that_is_not_installed_is_a_usage_error(
    pytester: pytest.Pytester, run: Callable[..., pytest.RunResult]
) -> None:
    pytester.makepyfile("def test_nothing(): pass\n")
    result = run("--capsafe-protect=cupy")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert usage_error(result).startswith(
        "ERROR: --capsafe-protect=cupy: cannot install (FrameworkNotInstalled: "
        "capsafe.integrations.cupy.install(): cupy is not installed"
    )


def test_protection_lets_a_cupy_capture_survive_the_neighbours(
    pytester: pytest.Pytester, run: Callable[..., pytest.RunResult]
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(CAPTURE_TEST)
    bare = run("--capsafe-neighbors", "2")
    bare.assert_outcomes(failed=1)
    assert "CaptureInvalidated" in bare.stdout.str()
    protected = run("--capsafe-neighbors", "2", "--capsafe-protect=cupy")
    protected.assert_outcomes(passed=1)
    assert "capsafe: protect=cupy" in protected.stdout.str()


# Loads the fake torch of tests/core/fake_torch.py as `torch`, over the process-wide sim driver.
FAKE_TORCH = FAKES.with_name("fake_torch.py")
TORCH_CONFTEST = f"""
import importlib.util, os, sys
os.environ["CAPSAFE_BACKEND"] = "sim"
from capsafe import driver
spec = importlib.util.spec_from_file_location("fake_torch", {str(FAKE_TORCH)!r})
fakes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fakes)
sys.modules["torch"] = fakes.fake_torch(driver.raw())
"""

TORCH_CAPTURE_TEST = """
import time
import pytest
import capsafe, torch

@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_torch_graph_beside_neighbours(mode):
    capsafe.device(0)
    ptr = torch.cuda.caching_alloc(4096)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        torch.cuda.fill(ptr, 1, 4096)
        time.sleep(0.1)
    g.replay()
"""


def test_protection_lets_torch_captures_survive_the_neighbours_in_every_mode(
    pytester: pytest.Pytester, run: Callable[..., pytest.RunResult]
) -> None:
    pytester.makeconftest(TORCH_CONFTEST)
    pytester.makepyfile(TORCH_CAPTURE_TEST)
    bare = run("--capsafe-neighbors", "2")
    bare.assert_outcomes(failed=3)
    assert "CaptureInvalidated" in bare.stdout.str()
    protected = run("--capsafe-neighbors", "2", "--capsafe-protect=torch")
    protected.assert_outcomes(passed=3)
    assert "capsafe: protect=torch" in protected.stdout.str()


def test_a_capture_left_open_by_a_test_is_released_after_it(
    pytester: pytest.Pytester, run: Callable[..., pytest.RunResult]
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        import threading
        import capsafe, cupy
        from capsafe.gate import gate

        def test_leaves_a_capture_open():
            capsafe.device(0)
            cupy.cuda.Stream().begin_capture()

        def test_next_one_finds_the_gate_open():
            done = threading.Event()
            def shared():
                with gate():
                    done.set()
            threading.Thread(target=shared, daemon=True).start()
            assert done.wait(60)  # a hang watchdog: it enters at once
        """
    )
    result = run("--capsafe-protect=cupy", "-W", "default")
    result.assert_outcomes(passed=2, warnings=1)
    assert "the test left a capture open (CuPy stream" in result.stdout.str()


def test_importing_the_integrations_imports_no_framework() -> None:
    code = (
        "import sys, capsafe.integrations.cupy, capsafe.integrations.cuda_core, "
        "capsafe.integrations.torch, capsafe_harness.plugin.protect, capsafe_harness.plugin\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch') "
        "or m.startswith('cuda.core')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_plugin_without_the_option_imports_no_integration() -> None:
    code = (
        "import sys, capsafe_harness.plugin\n"
        "print([m for m in sys.modules if m.startswith('capsafe.integrations')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_method_of_an_immutable_extension_type_is_replaced_and_restored() -> None:
    graph = pytest.importorskip("cuda.core.graph")
    cls = graph.GraphBuilder
    with pytest.raises(TypeError):
        cls.begin_building = lambda self, mode="relaxed": None  # what plain setattr does
    original = cls.__dict__["begin_building"]
    builder = cls.__new__(cls)
    patches = _patch.Patches()
    patches.replace(cls, "begin_building", lambda self, mode="relaxed": ("hooked", mode))
    try:
        assert builder.begin_building("global") == ("hooked", "global")
    finally:
        patches.restore()
    assert cls.__dict__["begin_building"] is original


def _summary(directory: Path, tests: list[tuple[str, str, list[str]]], *pytest_args: str) -> Path:
    """A sweep's summary.json and sweep.json; a test not `pass` failed 1 of 2 runs."""
    directory.mkdir()
    rows = [
        {"nodeid": n, "classification": c, "signals": s, "runs": 2, "failures": int(c != "pass"),
         "isolation_runs": 0, "isolation_failures": 0}
        for n, c, s in tests
    ]  # fmt: skip
    (directory / "summary.json").write_text(json.dumps({"tests": rows}))
    (directory / "sweep.json").write_text(json.dumps({"options": {"pytest_args": pytest_args}}))
    return directory


def test_survival_lists_each_capture_unsafe_test_and_whether_it_passed_protected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _summary(
        tmp_path / "bare",
        [
            ("t.py::a", "fail", ["capture-invalidated"]),
            ("t.py::b", "capture-unsafe", []),
            ("t.py::c", "fail", []),  # fails for another reason: not the protection's business
            ("t.py::d", "pass", []),
            ("t.py::e", "capture-unsafe", []),
        ],
    )
    after = _summary(
        tmp_path / "protected",
        [("t.py::a", "pass", []), ("t.py::b", "flaky", ["capture-invalidated"])],
        "-x",
        "--capsafe-protect=cupy",
    )
    assert protect.main([str(before), str(after)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "survived: t.py::a (fail without protection, pass with it)",
        "NOT protected: t.py::b (capture-unsafe without protection, flaky with it)",
        "no verdict: t.py::e (capture-unsafe without protection, not run with it)",
        "capsafe protect: 1 of 3 capture-unsafe tests pass with protection",
    ]
    ((_, _, _, runs),) = [r for r in protect.survival(before, after) if r[0] == "t.py::b"]
    assert (runs.frameworks, runs.survived, runs.capture_failures) == (("cupy",), False, 1)
    assert protect.main([str(before)]) == 2  # a one-sweep summary without protected reruns
    assert protect.main([]) == 2


def test_a_second_sweep_without_protection_gives_no_verdict(tmp_path: Path) -> None:
    before = _summary(tmp_path / "bare", [("t.py::a", "capture-unsafe", [])])
    after = _summary(tmp_path / "again", [("t.py::a", "pass", [])], "--capsafe-protect", "")
    ((_, _, now, runs),) = protect.survival(before, after)
    assert (now, runs.frameworks, runs.survived) == ("pass", (), None)
    assert protect.protected_by(["--capsafe-protect", "cuda_core", "--capsafe-protect=cupy"]) == (
        "cupy",
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sweeps_of_the_cuda_core_suite_without_and_with_protection(tmp_path: Path) -> None:
    sweep = [sys.executable, "-m", "capsafe.cli", "sweep", str(SUITES / "cuda_core_capture"),
             "--runs", "1", "--workers", "0", "--seed", "3", "--isolation-runs", "1",
             "--neighbors", "2", "--timeout", "20", "--no-progress"]  # fmt: skip
    lean = ["-p", "no:run-parallel", "-p", "no:hypothesispytest"]
    bare = subprocess.run([*sweep, "--out", str(tmp_path / "bare"), "--", *lean], timeout=280)
    assert bare.returncode == 1  # the raw capture is capture-unsafe beside the neighbours
    protected = subprocess.run(
        [*sweep, "--out", str(tmp_path / "on"), "--", *lean, "--capsafe-protect=cuda_core"],
        timeout=280,
    )
    assert protected.returncode == 0
    out = subprocess.run(
        [sys.executable, "-m", "capsafe_harness.report.protection", str(tmp_path / "bare"),
         str(tmp_path / "on")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "survived: test_graph_capture.py::test_three_captures (capture-unsafe" in out
    assert (
        out.splitlines()[-1] == "capsafe protect: 1 of 1 capture-unsafe tests pass with protection"
    )
