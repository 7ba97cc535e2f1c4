"""Measure which driver calls break an open CUDA-graph capture, and check capsafe.hazards.

For every cell of `capsafe.hazards.cells()` (call x capture mode x capture-stream
kind x calling thread) one trial opens a capture, makes the call, ends the
capture and records both results. The trial itself is
`capsafe.hazards.trial.run_trial`, the same code the simulated device is tested
with. On the real driver each trial runs in a fresh process (trials in parallel:
a capture never sees another process's calls), so no trial inherits state a
previous one left behind; the simulated device runs each trial on a fresh
in-process `SimBackend`, which isolates it just as well and takes milliseconds.

    python -m capsafe_repro.hazard_matrix --backend cuda --compare --json hazard.jsonl

prints the matrix, one summary line, and with --compare exits 1 listing every
cell where the measurement disagrees with the table. `--cross-device` measures
the same cells with the capture on device 0 and the call made in device 1's
context (`hazards.OTHER_DEVICE`); a machine with one device exits 2 saying so.
`--left-open` measures the same cells while the capture is left open after another
thread's cuCtxSynchronize invalidated it (`hazards.LEFT_OPEN`): what a test that never
ends a broken capture does to every later call in the process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from capsafe import driver, hazards
from capsafe.backend import Backend
from capsafe.backend_cuda import bindings_version, unavailable_reason
from capsafe.context import CudaDevice
from capsafe.errors import BackendUnavailable, CapsafeError
from capsafe.handles import CaptureMode, StreamKind
from capsafe.hazards.trial import ORDINALS, devices_needed, needs_devices_message

from .cli import run_main, write_output

KEYS = ("call", "mode", "stream", "caller", "device", "state", "call_result", "end_capture")
TRIAL_TIMEOUT_S = 120.0
#: A trial process killed by a signal is run again this many times. Observed on an
#: H200: a segfault in the trial's teardown (after the measurement, before it was
#: printed) in 2 of 312 trials; the rerun is counted in the summary, never hidden.
CRASH_RERUNS = 1
_REPO_ROOT = Path(__file__).resolve().parent.parent

_SHORT = {
    hazards.SUCCESS: "ok",
    hazards.UNSUPPORTED: "UNSUP",
    hazards.IMPLICIT: "IMPL",
    hazards.INVALIDATED: "INV",
}
LEGEND = (
    "ok: call and capture succeeded; UNSUP / IMPL: the call failed with "
    "STREAM_CAPTURE_UNSUPPORTED / _IMPLICIT and the capture ended INVALIDATED; "
    "A/B: call returned A, end of capture B; *: disagrees with capsafe.hazards"
)
LEFT_OPEN_LEGEND = (
    "Left open: another thread's cuCtxSynchronize invalidated the capture before the call, "
    "so it always ends INVALIDATED; ok / UNSUP / IMPL: what the call returned"
)

Cell = hazards.Cell
Row = dict[str, str]


def _device_of(row: Row) -> str:
    """A row's device relation; rows measured before the cross-device axis have none."""
    return row.get("device", hazards.SAME_DEVICE)


def _state_of(row: Row) -> str:
    """A row's capture state; rows measured before the left-open axis have none."""
    return row.get("state", hazards.ACTIVE)


@dataclass(frozen=True)
class Disagreement:
    row: Row
    expected: hazards.Outcome

    def describe(self) -> str:
        r = self.row
        state = _state_of(r)
        measured = _code(r["call_result"], r["end_capture"], state)
        wanted = _code(self.expected.call_result, self.expected.end_capture, state)
        where = "" if _device_of(r) == hazards.SAME_DEVICE else f" {_device_of(r)}"
        where += "" if state == hazards.ACTIVE else f" {state}"
        return (
            f"{r['call']} {r['mode']} {r['stream']} {r['caller']}{where}: measured {measured} "
            f"({r['call_result']}, end {r['end_capture']}), table says {wanted}"
        )


def _short(result: str) -> str:
    return _SHORT.get(result) or result.removeprefix("CUDA_ERROR_")


def _code(call_result: str, end_capture: str, state: str = hazards.ACTIVE) -> str:
    """Compact cell text: the call's result, plus the end of capture when it is a surprise
    (a left-open capture always ends INVALIDATED, so only another end is one)."""
    kept = call_result == hazards.SUCCESS and state == hazards.ACTIVE
    usual_end = hazards.SUCCESS if kept else hazards.INVALIDATED
    if end_capture == usual_end:
        return _short(call_result)
    return f"{_short(call_result)}/{_short(end_capture)}"


# -- one trial ----------------------------------------------------------------


def _row(cell: Cell, call_result: str, end_capture: str, capturing_after: str = "") -> Row:
    call, mode, stream, caller, device, state = cell
    row = {
        "call": call,
        "mode": CaptureMode.parse(mode).value,
        "stream": StreamKind(stream).value,
        "caller": caller,
        "device": device,
        "state": state,
        "call_result": call_result,
        "end_capture": end_capture,
    }
    if capturing_after:
        row["capturing_after"] = capturing_after
    return row


def measure(backend: Backend, cell: Cell) -> Row:
    """Run one trial on an initialized `backend`; a trial that cannot run becomes an ERROR row."""
    from capsafe.hazards.trial import run_trial

    try:
        held = [CudaDevice(backend, n) for n in sorted(set(ORDINALS[cell[4]]))]
        held[0].bind()  # the process's own retained primary contexts, the capture's bound
        result = run_trial(backend, *cell)
    except (CapsafeError, TimeoutError, RuntimeError) as exc:
        error = f"ERROR({type(exc).__name__}: {exc})".replace("\n", " ")
        return _row(cell, error, "ERROR")
    return _row(cell, result.call_result, result.end_capture, result.capturing_after)


def _trial_main(cell: Cell, backend_name: str) -> int:
    """`--trial`: one cell in this (fresh) process, printed as one JSON line."""
    backend, _ = driver.create_backend(backend_name)
    backend.init()
    print(json.dumps(measure(backend, cell)), flush=True)
    return 0


# -- running the matrix -------------------------------------------------------


def _in_process_sim(cell: Cell) -> Row:
    backend, _ = driver.create_backend("sim")  # CAPSAFE_SIM_DEVICES devices
    backend.init()
    return measure(backend, cell)


def _in_fresh_process(backend_name: str) -> Callable[[Cell], Row]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )

    def run(cell: Cell) -> Row:
        call, mode, stream, caller, device, state = cell
        command = [sys.executable, "-m", "capsafe_repro.hazard_matrix", "--backend", backend_name]
        command += ["--trial", call, CaptureMode.parse(mode).value, StreamKind(stream).value]
        command.append(caller)
        if device == hazards.OTHER_DEVICE:
            command.append("--cross-device")
        if state == hazards.LEFT_OPEN:
            command.append("--left-open")
        reruns = -1
        while reruns < CRASH_RERUNS:
            reruns += 1
            try:
                done = subprocess.run(
                    command, env=env, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                return _row(cell, f"ERROR(trial process hung for {TRIAL_TIMEOUT_S:.0f} s)", "ERROR")
            if done.returncode >= 0:
                break
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return _row(cell, f"ERROR(trial exit {done.returncode}: {last})", "ERROR")
        try:
            row = json.loads(lines[-1])
        except ValueError:
            row = None
        if not isinstance(row, dict):
            return _row(cell, f"ERROR(trial printed no result: {lines[-1][:200]})", "ERROR")
        if reruns:
            row["reruns"] = reruns
        return row

    return run


def run_matrix(
    cells: Sequence[Cell], backend_name: str, *, jobs: int, in_process: bool
) -> list[Row]:
    """Every cell measured, in the order given."""
    trial = _in_process_sim if in_process else _in_fresh_process(backend_name)
    if in_process:
        return [trial(cell) for cell in cells]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(trial, cells))


def disagreements(rows: Iterable[Row]) -> list[Disagreement]:
    """Every row whose measured outcome differs from `hazards.expected` for its cell."""
    found = []
    for row in rows:
        want = hazards.expected(
            row["call"], row["mode"], row["stream"], row["caller"], _device_of(row), _state_of(row)
        )
        if (row["call_result"], row["end_capture"]) != (want.call_result, want.end_capture):
            found.append(Disagreement(row, want))
    return found


# -- printing -----------------------------------------------------------------

_CELL_W = 6
_STREAM_ABBR = {StreamKind.NONBLOCKING: "nb", StreamKind.BLOCKING: "bl"}
_CALLER_ABBR = {hazards.SAME_THREAD: "s", hazards.OTHER_THREAD: "o"}


def _columns() -> list[tuple[CaptureMode, StreamKind, str]]:
    return [
        (mode, stream, caller)
        for mode in hazards.MODES
        for stream in hazards.CAPTURE_STREAMS
        for caller in hazards.CALLERS
    ]


def format_table(rows: Sequence[Row]) -> str:
    """Call rows x (mode, capture stream, caller) columns of compact outcome codes.

    The rows are of one capture state (a run measures one)."""
    state = _state_of(rows[0]) if rows else hazards.ACTIVE
    by_cell = {(r["call"], r["mode"], r["stream"], r["caller"]): r for r in rows}
    bad = {
        (d.row["call"], d.row["mode"], d.row["stream"], d.row["caller"])
        for d in disagreements(rows)
    }
    calls = [c for c in hazards.CALLS if any(r["call"] == c for r in rows)]
    name_w = max(len(c) for c in [*calls, "call"]) + 2
    group_w = _CELL_W * len(hazards.CAPTURE_STREAMS) * len(hazards.CALLERS)
    modes = "".join(f"{m.name:<{group_w}}| " for m in hazards.MODES)
    subs = "".join(
        f"{_STREAM_ABBR[s] + '/' + _CALLER_ABBR[c]:<{_CELL_W}}"
        + ("| " if (s, c) == (hazards.CAPTURE_STREAMS[-1], hazards.CALLERS[-1]) else "")
        for _m, s, c in _columns()
    )
    lines = [f"{'':<{name_w}}{modes}".rstrip(), f"{'call':<{name_w}}{subs}".rstrip()]
    for call in calls:
        text = ""
        for mode, stream, caller in _columns():
            key = (call, mode.value, stream.value, caller)
            row = by_cell.get(key)
            code = "-" if row is None else _code(row["call_result"], row["end_capture"], state)
            code += "*" if key in bad else ""
            text += f"{code:<{_CELL_W}}"
            if (stream, caller) == (hazards.CAPTURE_STREAMS[-1], hazards.CALLERS[-1]):
                text += "| "
        lines.append(f"{call:<{name_w}}{text}".rstrip())
    lines.append("columns: nb/bl = non-blocking/blocking capture stream, s/o = call made on the")
    lines.append("capturing thread / another thread. " + LEGEND)
    if state == hazards.LEFT_OPEN:
        lines.append(LEFT_OPEN_LEGEND)
    return "\n".join(lines)


_STATE = {hazards.ACTIVE: "", hazards.LEFT_OPEN: ", an invalidated capture left open"}
_RELATION = {
    hazards.SAME_DEVICE: "",
    hazards.OTHER_DEVICE: ", capture on device 0 and call on device 1",
}


def summary_line(rows: Sequence[Row], where: str, seconds: float) -> str:
    broke = sum(r["end_capture"] != hazards.SUCCESS for r in rows)
    relations = {_device_of(r) for r in rows}
    states = {_state_of(r) for r in rows}
    errors = sum(r["end_capture"] == "ERROR" for r in rows)
    calls = len({r["call"] for r in rows})
    text = (
        f"{len(rows)} trials ({calls} calls x {len(hazards.MODES)} modes x "
        f"{len(hazards.CAPTURE_STREAMS)} capture streams x {len(hazards.CALLERS)} callers"
        f"{''.join(_RELATION[d] for d in hazards.DEVICES if d in relations)}"
        f"{''.join(_STATE[s] for s in hazards.STATES if s in states)}) "
        f"on {where} in {seconds:.1f} s: "
    )
    if hazards.LEFT_OPEN in states:
        refused = sum(r["call_result"] != hazards.SUCCESS for r in rows)
        text += f"{len(rows) - refused} calls succeeded, {refused - errors} were refused"
    else:
        text += f"{len(rows) - broke} kept the capture, {broke - errors} broke it"
    if errors:
        text += f", {errors} trial(s) failed to run"
    reruns = sum(1 for r in rows if r.get("reruns"))
    if reruns:
        text += f", {reruns} trial(s) rerun after their process died by a signal"
    text += f"; {len(disagreements(rows))} disagreement(s) with capsafe.hazards"
    predicted = [
        " ".join(x for x in (d, s) if x not in (hazards.SAME_DEVICE, hazards.ACTIVE))
        for d in hazards.DEVICES
        for s in hazards.STATES
        if d in relations and s in states and not hazards.measured(d, s)
    ]
    if predicted:
        text += f" (the table's {', '.join(predicted)} rules are partly predictions until measured)"
    return text


def hold_devices(backend_name: str, device: str) -> tuple[list[CudaDevice], str]:
    """The devices `device`'s cells use, primary contexts retained here for the whole run,
    and a description.

    Holding a context in the parent keeps the GPU initialized between trial
    processes even without persistence mode; captures never cross processes, so
    it cannot influence a trial. Too few devices is `BackendUnavailable`, one line.
    """
    backend, _ = driver.create_backend(backend_name)
    backend.init()
    if problem := needs_devices_message(device, backend.device_get_count()):
        hint = "; set CAPSAFE_SIM_DEVICES=2 for the simulated one" if backend.name == "sim" else ""
        raise BackendUnavailable(f"--cross-device {problem}{hint}")
    held = [CudaDevice(backend, n) for n in range(devices_needed(device))]
    first = held[0].bind()
    count = f"{len(held)} x " if len(held) > 1 else ""
    text = f"{backend.name}: {count}{first.name}, driver {backend.driver_version()}"
    if backend_name == "cuda":
        text += f", cuda-bindings {bindings_version()}"
    return held, text


def rules_markdown() -> str:
    """capsafe.hazards as Markdown: one row per rule, then the calls no rule names."""

    def names(items: Iterable[object], everything: Sequence[object]) -> str:
        chosen = [str(getattr(i, "name", i)) for i in everything if i in set(items)]
        return "any" if len(chosen) == len(everything) else ", ".join(chosen)

    lines = [
        "| rule | calls | modes | capture stream | caller | device | capture | measured "
        "| the call returns | why |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rule in hazards.RULES:
        calls = "<br>".join(f"`{c}`: {hazards.CALLS[c]}" for c in hazards.CALLS if c in rule.calls)
        lines.append(
            f"| {rule.name} | {calls} | {names(rule.modes, hazards.MODES)} "
            f"| {names(rule.streams, hazards.CAPTURE_STREAMS)} "
            f"| {names(rule.callers, hazards.CALLERS)} | {names(rule.devices, hazards.DEVICES)} "
            f"| {names(rule.states, hazards.STATES)} "
            f"| {'yes' if rule.measured else '**no: predicted**'} "
            f"| `{_short(rule.result)}`, capture "
            f"{'stays invalidated' if rule.states == {hazards.LEFT_OPEN} else 'invalidated'} "
            f"| {rule.why} |"
        )
    safe = [c for c in hazards.CALLS if not hazards.ever_breaks(c)]
    lines.append("")
    lines.append(
        "Every other call kept the capture in every same-device cell (and is predicted to "
        "keep it in every other-device cell, and to succeed beside a left-open capture):"
    )
    lines.append("")
    lines += [f"- `{c}`: {hazards.CALLS[c]}" for c in safe]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m capsafe_repro.hazard_matrix",
        description=(
            "Measure, for every call in capsafe.hazards x capture mode x capture-stream kind x "
            "calling thread, what the call returns while a capture is open and how the capture "
            "ends; print the matrix and compare it with the rule table."
        ),
    )
    parser.add_argument(
        "--backend",
        choices=("sim", "cuda"),
        help="sim: the simulated device; cuda: the real driver (needs a GPU); "
        "default: CAPSAFE_BACKEND, where auto takes cuda when a GPU answers",
    )
    parser.add_argument("--json", metavar="PATH", help="write one JSON object per trial here")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="exit 1 and list every cell where the measurement disagrees with capsafe.hazards",
    )
    parser.add_argument(
        "--calls",
        metavar="A,B",
        help=f"only these calls (default: all {len(hazards.CALLS)}: {', '.join(hazards.CALLS)})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="trial processes run at once (default: the CPU count)",
    )
    parser.add_argument(
        "--process-per-trial",
        action="store_true",
        help="run sim trials in fresh processes too (cuda trials always are)",
    )
    parser.add_argument(
        "--cross-device",
        action="store_true",
        help="capture on device 0, make the call in device 1's context (needs 2 devices; "
        "the sim has CAPSAFE_SIM_DEVICES)",
    )
    parser.add_argument(
        "--left-open",
        action="store_true",
        help="make each call while the capture is left open after another thread's "
        "cuCtxSynchronize invalidated it (the capture ends INVALIDATED in every cell)",
    )
    parser.add_argument(
        "--rules",
        action="store_true",
        help="print the rule table of capsafe.hazards as Markdown (as in docs/hazards.md) and exit",
    )
    parser.add_argument(
        "--trial",
        nargs=4,
        metavar=("CALL", "MODE", "STREAM", "CALLER"),
        help="internal: run one trial in this process and print it as one JSON line",
    )
    return parser


def _selected_cells(
    parser: argparse.ArgumentParser, calls: str | None, device: str, state: str
) -> list[Cell]:
    if not calls:
        return list(hazards.cells(device, state))
    wanted = [c.strip() for c in calls.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in hazards.CALLS]
    if unknown:
        parser.error(f"unknown call(s) {', '.join(unknown)}; known: {', '.join(hazards.CALLS)}")
    return [cell for cell in hazards.cells(device, state) if cell[0] in wanted]


def _parse_trial(
    parser: argparse.ArgumentParser, trial: Sequence[str], device: str, state: str
) -> Cell:
    call, mode, stream, caller = trial
    try:
        hazards.rule_for(call, mode, stream, caller, device, state)
        return call, CaptureMode.parse(mode), StreamKind(stream), caller, device, state
    except (KeyError, ValueError) as exc:
        parser.error(f"bad --trial {' '.join(trial)}: {exc}")


def _default_backend() -> str:
    """CAPSAFE_BACKEND, parsed as every capsafe command parses it; auto decided here."""
    name = driver.requested_backend()
    if name == "auto":
        return "sim" if unavailable_reason() else "cuda"
    return name


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.rules:
        print(rules_markdown())
        return 0
    device = hazards.OTHER_DEVICE if args.cross_device else hazards.SAME_DEVICE
    state = hazards.LEFT_OPEN if args.left_open else hazards.ACTIVE
    try:
        args.backend = args.backend or _default_backend()
        if args.trial:
            return _trial_main(_parse_trial(parser, args.trial, device, state), args.backend)
        cells = _selected_cells(parser, args.calls, device, state)
        if args.backend == "cuda" and (reason := unavailable_reason()):
            raise BackendUnavailable(f"--backend cuda needs a GPU, but {reason}; use --backend sim")
        _held, where = hold_devices(args.backend, device)
    except BackendUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    in_process = args.backend == "sim" and not args.process_per_trial
    rows = run_matrix(cells, args.backend, jobs=args.jobs, in_process=in_process)
    seconds = time.perf_counter() - started
    if args.json:
        write_output(Path(args.json), "".join(json.dumps(r) + "\n" for r in rows))
    print(format_table(rows))
    isolation = "in-process fresh SimBackend per trial" if in_process else "one process per trial"
    print()
    print(summary_line(rows, f"{where} ({isolation})", seconds))
    found = disagreements(rows)
    if args.compare and found:
        print(f"{len(found)} cell(s) disagree with capsafe.hazards:", file=sys.stderr)
        for item in found:
            print(f"  {item.describe()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "capsafe_repro.hazard_matrix"))
