"""The report's GPU section: capture-unsafe tests, frozen-config changes, CUDA/CAPSAFE leaks."""

from __future__ import annotations

from typing import Any

from capsafe_harness.report import gpu_report

FROZEN = (
    "FrozenConfigError: configuration 'runtime' changed after it froze at x.py:3:\n"
    "  CAPSAFE_GATE: frozen '1', now '0'\n"
    "  CUDA_MODULE_LOADING: frozen unset, now 'LAZY'\n"
)
UNSAFE: dict[str, Any] = {
    "nodeid": "t.py::test_graph",
    "classification": "capture-unsafe",
    "capture": {"verdict": "breaks under: ctx_sync; survives: mem_alloc", "breaks": ["ctx_sync"],
                "advice": "captured in RELAXED mode", "replay": "cd x && pytest t.py"},
}  # fmt: skip


def _rows() -> list[dict[str, Any]]:
    return [
        {"nodeid": "t.py::test_env", "phase": "teardown", "signals": ["env-leak"],
         "env_leak": {"CUDA_VISIBLE_DEVICES": [None, "1"], "HOME": ["/a", "/b"]}},
        {"nodeid": "t.py::test_cfg", "phase": "call", "signals": ["frozen-config"],
         "message": FROZEN.splitlines()[0], "details": FROZEN},
    ]  # fmt: skip


def test_section_gathers_what_a_gpu_engineer_reads_first() -> None:
    neighbors = {"processes": 3, "backend": ["cuda"], "calls": {"ctx_sync": 9},
                 "driver_errors": {"ctx_sync": 2}, "problems": [], "unavailable": []}  # fmt: skip
    gpu = gpu_report.gpu_section([UNSAFE, {**UNSAFE, "classification": "pass"}], _rows(), neighbors)
    assert [t["nodeid"] for t in gpu["capture_unsafe"]] == ["t.py::test_graph"]
    (frozen,) = gpu["frozen_config"]
    assert frozen["changes"] == [
        {"variable": "CAPSAFE_GATE", "frozen": "'1'", "now": "'0'"},
        {"variable": "CUDA_MODULE_LOADING", "frozen": "unset", "now": "'LAZY'"},
    ]
    assert gpu["env_leaks"] == [
        {"nodeid": "t.py::test_env", "variable": "CUDA_VISIBLE_DEVICES", "before": None,
         "after": "1"}
    ]  # fmt: skip
    md = "\n".join(gpu_report.markdown(gpu))
    assert "their own driver errors: ctx_sync 2" in md
    assert "`t.py::test_graph` is capture-unsafe: breaks under: ctx_sync" in md
    assert "CUDA_MODULE_LOADING: frozen unset, now 'LAZY'" in md
    html = gpu_report.html_section(gpu)
    assert "<b>capture-unsafe</b>" in html and "CUDA_VISIBLE_DEVICES" in html


def test_neighbours_that_could_not_start_are_the_headline() -> None:
    gpu = gpu_report.gpu_section([], [], {"processes": 1, "unavailable": ["UsageError: nope"]})
    assert gpu_report.markdown(gpu)[2].startswith("Neighbour threads could not start: UsageError")
    assert "could not start" in gpu_report.html_section(gpu)


def test_nothing_gpu_related_adds_nothing() -> None:
    gpu = gpu_report.gpu_section([], [], None)
    assert gpu_report.markdown(gpu) == [] and gpu_report.html_section(gpu) == ""


def test_each_capture_unsafe_test_says_whether_it_survived_protection() -> None:
    survived = {
        **UNSAFE,
        "capture": {
            **UNSAFE["capture"],
            "survived": True,
            "protection": "with protection: survived 3/3 (cupy)",
        },
    }
    older = {**UNSAFE, "nodeid": "t.py::test_old"}  # a summary from before --protect
    gpu = gpu_report.gpu_section([survived, older], [], None)
    assert gpu["capture_unsafe"][0]["survived"] is True
    md = gpu_report.markdown(gpu)
    assert "  With protection: survived 3/3 (cupy)." in md
    assert sum("protection" in line for line in md) == 1
    assert "<p>With protection: survived 3/3 (cupy).</p>" in gpu_report.html_section(gpu)
