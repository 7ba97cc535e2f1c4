"""A capture invalidated and left open: the H200 probe of 2026-12-01, replayed on the sim.

docs/data/h200_2026-12-01_left_open/ holds the probe and its rows: a thread begins a
capture, another thread's cuCtxSynchronize invalidates it, nobody ends it; meanwhile the
main thread and a fresh thread try cuMemAlloc, cuMemFree, cuCtxSynchronize and a capture
of their own; then the capture is ended and the calls retried. `probe` makes the same
calls through the facade, so each row is reproduced on the sim (and, with `-m cuda`, the
probe is re-run on the GPU through capsafe's own driver). The table must say the same.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.errors import CudaError
from capsafe.handles import CaptureMode, CaptureStatus, Context, Stream

DATA = Path(__file__).resolve().parents[2] / "docs" / "data" / "h200_2026-12-01_left_open"
ROWS = [
    json.loads(line)
    for line in (DATA / "open_invalidated_h200_drv580.159.04_2026-12-01.jsonl")
    .read_text()
    .splitlines()
    if line.strip()
]
PROBE_CALLS = {"mem_alloc", "mem_free", "ctx_sync"}  # the table's rows among the probe's keys
Outcomes = dict[str, str]


def _name(fn: Callable[[], object]) -> tuple[str, object]:
    """The probe's spelling: "ok" or the CUresult name, and what the call returned."""
    try:
        return "ok", fn()
    except CudaError as exc:
        return exc.result, None


def _calls(b: Backend) -> Outcomes:
    """The probe's `calls()`: alloc (and free when it worked), sync, a capture of one's own."""
    out: Outcomes = {}
    out["mem_alloc"], ptr = _name(lambda: b.mem_alloc(1 << 20))
    if out["mem_alloc"] == "ok":
        out["mem_free"], _ = _name(lambda: b.mem_free(ptr))  # type: ignore[arg-type]
    out["ctx_sync"], _ = _name(b.ctx_synchronize)
    stream = b.stream_create(nonblocking=True)
    out["own_begin"], _ = _name(lambda: b.stream_begin_capture(stream, CaptureMode.GLOBAL))
    if out["own_begin"] == "ok":
        out["own_end"], graph = _name(lambda: b.stream_end_capture(stream))
        if graph is not None:
            b.graph_destroy(graph)  # type: ignore[arg-type]
    b.stream_destroy(stream)
    return out


def _in_thread(b: Backend, context: Context, fn: Callable[[], Outcomes]) -> Outcomes:
    box: list[Outcomes] = []

    def run() -> None:
        b.ctx_set_current(context)
        box.append(fn())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert box, "the probe's fresh thread did not finish"
    return box[0]


def probe(b: Backend, mode: CaptureMode) -> dict[str, object]:
    """One line of open_invalidated_probe.py, made through the facade on `b` (context bound)."""
    context = b.ctx_get_current()
    assert context is not None
    state: dict[str, object] = {}
    ready, go, done, end, ended = (threading.Event() for _ in range(5))
    streams: list[Stream] = []

    def capturer() -> None:
        b.ctx_set_current(context)
        stream = b.stream_create(nonblocking=True)
        streams.append(stream)
        state["begin"], _ = _name(lambda: b.stream_begin_capture(stream, mode))
        ready.set()
        go.wait(60)
        state["status_after_sync"] = b.stream_is_capturing(stream)
        done.set()
        end.wait(60)
        state["end"], graph = _name(lambda: b.stream_end_capture(stream))
        if graph is not None:
            b.graph_destroy(graph)  # type: ignore[arg-type]
        ended.set()

    thread = threading.Thread(target=capturer)
    thread.start()
    assert ready.wait(60)
    row: dict[str, object] = {"mode": mode.value}
    row["breaker_ctx_sync"], _ = _name(b.ctx_synchronize)
    go.set()
    assert done.wait(60)
    row.update(capture_begin=state["begin"], status_after_sync=state["status_after_sync"])
    row["left_open_main"] = _calls(b)
    row["left_open_new_thread"] = _in_thread(b, context, lambda: _calls(b))
    end.set()
    assert ended.wait(60)
    thread.join(60)
    row["end"] = state["end"]
    row["after_end_main"] = _calls(b)
    b.stream_destroy(streams[0])
    return row


def _as_measured(raw: dict[str, object]) -> dict[str, object]:
    """A probe row with the capture status as capsafe names it ("...STATUS_INVALIDATED: 2>")."""
    text = str(raw["status_after_sync"])
    return {**raw, "status_after_sync": next(s for s in CaptureStatus if s.name in text)}


@pytest.mark.parametrize("raw", ROWS, ids=[str(r["mode"]) for r in ROWS])
def test_the_probe_gives_each_measured_row(backend: Backend, raw: dict[str, object]) -> None:
    assert probe(backend, CaptureMode.parse(str(raw["mode"]))) == _as_measured(raw)


@pytest.mark.parametrize("raw", ROWS, ids=[str(r["mode"]) for r in ROWS])
def test_the_table_says_what_each_row_measured(raw: dict[str, object]) -> None:
    """Both callers of the probe are other threads than the capturing one; the rules that
    decide these cells are marked measured."""
    mode = CaptureMode.parse(str(raw["mode"]))
    for caller_key in ("left_open_main", "left_open_new_thread"):
        got = raw[caller_key]
        assert isinstance(got, dict)
        for call in PROBE_CALLS & got.keys():
            args = (call, mode, "nonblocking", hazards.OTHER_THREAD)
            rule = hazards.rule_for(*args, hazards.SAME_DEVICE, hazards.LEFT_OPEN)
            want = hazards.SUCCESS if rule is None else rule.result
            assert (got[call] if got[call] != "ok" else hazards.SUCCESS) == want, (caller_key, call)
            assert rule is None or rule.measured, rule


def test_a_later_allocation_fails_until_the_global_capture_is_ended(sim_backend: Backend) -> None:
    """The cascade issue 20 found in CuPy's suite: a capture broken and never ended fails a
    later, non-capturing allocation; ending it (or destroying its stream) clears that."""
    b = sim_backend
    context = b.ctx_get_current()
    assert context is not None
    stream = b.stream_create(nonblocking=True)
    b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    breaker = _in_thread(b, context, lambda: {"sync": _name(b.ctx_synchronize)[0]})
    assert breaker == {"sync": hazards.UNSUPPORTED}
    assert b.stream_is_capturing(stream) is CaptureStatus.INVALIDATED
    later = _in_thread(b, context, lambda: {"alloc": _name(lambda: b.mem_alloc(16))[0]})
    assert later == {"alloc": hazards.UNSUPPORTED}
    b.stream_destroy(stream)  # drops the capture, as ending it does
    ptr = b.mem_alloc(16)
    b.mem_free(ptr)
