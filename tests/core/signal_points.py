"""Step an exception through every point where CPython can deliver a signal in one capture cycle.

CPython runs a Python-level signal handler (Ctrl-C's KeyboardInterrupt,
pytest-timeout's signal method) in the main thread at three kinds of places
only: the entry of a Python function (RESUME), right after a call returns (the
end of CALL) and at a backward jump. The checker runs a cycle once under
`sys.settrace` with opcode events and numbers every such place inside capsafe's
own frames, then runs it again once per point in a fresh world, raising
`Injected` there (from the tracer, so the traceback looks as a Python handler's
does), and then asks: is the gate still usable (another thread begins and ends a
capture and makes a gated call within a watchdog) and is nothing left held?

Not points: the simulated driver's frames (a real driver call is C: no signal
lands inside it) and the caller's own code (the frames that call capsafe). At
the entry of a public call made from the caller's code nothing has happened yet
except on the *end* side, where the capture is still open and held: there the
cycle's `recover` (the end call, made again) must leave everything clean; every
other point must be clean as it is.
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import capsafe
from capsafe.backend import Backend
from capsafe.driver import GatedDriver
from capsafe.gate import CaptureGate
from capsafe.handles import CaptureMode
from capsafe.sim import SimBackend

_CAPSAFE = os.path.dirname(os.path.abspath(capsafe.__file__)) + os.sep
_SIM = _CAPSAFE + "sim" + os.sep
_CALLS = {"CALL", "CALL_FUNCTION_EX", "CALL_KW"}
_BACKWARD = {"JUMP_BACKWARD"}  # JUMP_BACKWARD_NO_INTERRUPT does not check (a `yield from`)
WATCHDOG_S = 10.0  # far above a normal run: only a wedged gate reaches it
GATE_TIMEOUT_S = 2.0


class Injected(BaseException):
    """The exception the checker raises at one delivery point (a signal handler's)."""


@dataclass
class World:
    """A fresh sim, gate and facade for one run of a cycle, and what the cycle keeps."""

    backend: SimBackend
    gate: CaptureGate
    facade: GatedDriver
    context: Any
    extra: dict[str, Any] = field(default_factory=dict)
    undo: list[Callable[[], object]] = field(default_factory=list)


def new_world() -> World:
    backend = SimBackend()
    backend.init()
    context = backend.primary_ctx_retain(backend.device_get(0))
    backend.ctx_set_current(context)
    gate = CaptureGate(shared_timeout=GATE_TIMEOUT_S)
    facade = GatedDriver(backend, gate, capture_timeout=GATE_TIMEOUT_S)
    return World(backend, gate, facade, context)


@dataclass(frozen=True)
class Point:
    kind: str  # "entry", "after call", "backward jump"
    where: str  # function:line
    public: bool  # the entry of a call made from the caller's own code


@dataclass
class Cycle:
    """One capture cycle as a caller writes it, and how that caller recovers."""

    name: str
    setup: Callable[[World], None]
    run: Callable[[World], None]
    recover: Callable[[World], None]  # the end call made again (after an end-side entry)
    teardown: Callable[[World], None] = lambda world: None
    watched: Callable[[World], list[str]] = lambda world: []  # what else must be empty


@functools.cache
def _code_facts(code: types.CodeType) -> tuple[dict[int, tuple[str, Any, int]], list[Any]]:
    """offset -> (opname, argval, next offset), and the exception table, of one code object."""
    instructions = list(dis.get_instructions(code))
    ops = {
        i.offset: (
            i.opname,
            i.argval,
            instructions[k + 1].offset if k + 1 < len(instructions) else -1,
        )
        for k, i in enumerate(instructions)
    }
    return ops, dis._parse_exception_table(code)  # type: ignore[attr-defined]


class _Tracer:
    """Counts delivery points in capsafe's frames; raises `Injected` at the chosen one."""

    def __init__(self, target: int | None) -> None:
        self.target = target
        self.points: list[Point] = []
        self.last: dict[types.FrameType, int] = {}
        self.fired: Point | None = None

    def _handler(self, code: types.CodeType, offset: int) -> int | None:
        # CPython raises a signal at a call's end as part of that call: the call's own
        # exception handler catches it. Where the next instruction has another handler
        # (`return f()` inside `try`/`with`: the finally body is copied after the call)
        # an exception raised there by the tracer would not be what a signal does, so
        # such a point is left out (the call's handler runs as for an exception inside).
        for entry in _code_facts(code)[1]:
            if entry.start <= offset < entry.end:
                return int(entry.target)
        return None

    def _point(self, frame: types.FrameType, kind: str, public: bool) -> None:
        if self.fired is not None:
            return
        point = Point(kind, f"{frame.f_code.co_name}:{frame.f_lineno}", public)
        if self.target is not None and len(self.points) == self.target:
            self.fired = point
            self.points.append(point)
            raise Injected(f"point {self.target}: {kind} at {point.where}")
        self.points.append(point)

    def on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        filename = frame.f_code.co_filename
        if not filename.startswith(_CAPSAFE) or filename.startswith(_SIM):
            return None
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.startswith(_SIM):
            return None  # called by the simulated driver: inside a driver call
        public = caller is None or not _ours(caller.f_code.co_filename)
        frame.f_trace_opcodes = True
        self.last.pop(frame, None)
        self._point(frame, "entry", public)
        return self.local

    def local(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            current = frame.f_lasti
            previous = self.last.get(frame)
            self.last[frame] = current
            if previous is not None:
                before = _code_facts(frame.f_code)[0].get(previous)
                if before is not None:
                    opname, target, following = before
                    if (
                        opname in _CALLS
                        and current == following
                        and self._handler(frame.f_code, previous)
                        == self._handler(frame.f_code, current)
                    ):
                        self._point(frame, "after call", False)
                    elif opname in _BACKWARD and current == target:
                        self._point(frame, "backward jump", False)
        elif event == "return":
            self.last.pop(frame, None)
        return self.local


def _ours(filename: str) -> bool:
    return filename.startswith(_CAPSAFE) and not filename.startswith(_SIM)


@contextmanager
def _traced(tracer: _Tracer) -> Iterator[None]:
    # CPython 3.12 sends opcode events to a frame only if some frame asked for them
    # before settrace (python/cpython#114480): without this, the first frames a cycle
    # runs get none, and their after-call points are never counted nor checked.
    sys._getframe().f_trace_opcodes = True
    sys.settrace(tracer.on_call)
    try:
        yield
    finally:
        sys.settrace(None)


def problems(world: World, cycle: Cycle) -> list[str]:
    """What is left held in `world`, and whether another thread can still capture and call."""
    found = []
    stats = world.gate.stats()
    if stats.open_captures:
        found.append(f"{stats.open_captures} capture(s) left open")
    if stats.holders:
        found.append("held by " + "; ".join(h.describe() for h in stats.holders))
    found += cycle.watched(world)
    if found:  # already unusable: no need to wait for another thread to time out
        return found
    errors: list[BaseException] = []

    def other() -> None:
        try:
            world.backend.ctx_set_current(world.context)
            stream = world.facade.stream_create(nonblocking=True)
            with capsafe.capture(
                stream, CaptureMode.GLOBAL, driver=cast(Backend, world.facade)
            ) as cap:
                pass
            assert cap.graph is not None
            world.facade.graph_destroy(cap.graph)
            world.facade.mem_free(world.facade.mem_alloc(1 << 12))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other, name="signal-points-other")
    thread.start()
    thread.join(WATCHDOG_S)
    if thread.is_alive():
        found.append(f"another thread is still stuck after {WATCHDOG_S:g} s")
    elif errors:
        found.append(f"another thread failed: {errors[0]!r}")
    return found


@dataclass
class Report:
    cycle: str
    points: int
    bad: list[tuple[Point, list[str]]]
    public_end_entries: int  # points where the caller's retry of the end call was needed


def check(cycle: Cycle) -> Report:
    """Run `cycle` once per delivery point with an exception there; the points left unusable."""
    dry = _Tracer(None)
    world = new_world()
    cycle.setup(world)
    try:
        with _traced(dry):
            cycle.run(world)
    finally:
        cycle.teardown(world)
    bad: list[tuple[Point, list[str]]] = []
    retried = 0
    for n in range(len(dry.points)):
        world = new_world()
        cycle.setup(world)
        tracer = _Tracer(n)
        try:
            try:
                with _traced(tracer):
                    cycle.run(world)
            except Injected:
                pass
            point = tracer.fired
            if point is None:  # this run took another path: nothing was injected
                continue
            found = problems(world, cycle)
            if found and point.public:
                retried += 1
                cycle.recover(world)
                found = problems(world, cycle)
            if found:
                bad.append((point, found))
        finally:
            cycle.teardown(world)
    return Report(cycle.name, len(dry.points), bad, retried)


# -- the cycles -----------------------------------------------------------------------


def _stream(world: World) -> None:
    world.extra["stream"] = world.facade.stream_create(nonblocking=True)
    world.extra["ptr"] = world.facade.mem_alloc(1 << 12)


def _facade_capture(world: World) -> None:
    stream = world.extra["stream"]
    with capsafe.capture(stream, CaptureMode.GLOBAL, driver=cast(Backend, world.facade)) as cap:
        world.facade.memset_d8_async(world.extra["ptr"], 0, 1 << 12, stream)
    assert cap.graph is not None
    world.facade.graph_destroy(cap.graph)


def _facade_recover(world: World) -> None:
    stream = world.extra["stream"]
    if world.backend.stream_is_capturing(stream).value != "none":
        world.facade.graph_destroy(world.facade.stream_end_capture(stream))


def _facade_watched(world: World) -> list[str]:
    return ["the facade still records a window"] if world.facade._windows else []


def _gated_call(world: World) -> None:
    world.facade.mem_free(world.facade.mem_alloc(1 << 12))


def _gate_capture(world: World) -> None:
    guard = world.extra["guard"] = world.gate.begin_capture(label="checker")
    try:
        pass
    finally:
        guard.release()


def _gate_recover(world: World) -> None:
    guard = world.extra.get("guard")
    if guard is not None:
        guard.release()


GATE_CAPTURE = Cycle("gate capture", lambda world: None, _gate_capture, _gate_recover)
FACADE_CAPTURE = Cycle(
    "facade capture", _stream, _facade_capture, _facade_recover, watched=_facade_watched
)
GATED_CALL = Cycle("gated call", _stream, _gated_call, lambda world: None)


# -- the integrations, over the fakes their tests use ----------------------------------


def _integration_cycles(name: str) -> tuple[Cycle, Cycle]:
    """(through the installed hooks, through the integration's `capture()`) for one fake."""
    from capsafe.integrations import cuda_core, cupy

    module: Any = cupy if name == "cupy" else cuda_core

    def setup(world: World) -> None:
        saved = {k: sys.modules.get(k) for k in ("cupy", "cuda.core", "cuda.core.graph")}
        if name == "cupy":
            from test_integrations_cupy import fake_cupy

            fake = sys.modules["cupy"] = fake_cupy(world.backend)
            world.extra["make"] = lambda: fake.cuda.Stream()
        else:
            from test_integrations_cuda_core import fake_cuda_core

            core, graph = fake_cuda_core(world.backend)
            sys.modules["cuda.core"], sys.modules["cuda.core.graph"] = core, graph
            world.extra["make"] = lambda: core.Device().create_graph_builder()
        world.extra["saved"] = saved
        module.install(world.facade)
        world.extra["it"] = world.extra["make"]()

    def teardown(world: World) -> None:
        module.windows.release_all()
        # A bad point's leftovers must not reach the next run.
        getattr(module.windows, "_beginning", {}).clear()
        module.uninstall()
        for key, value in world.extra["saved"].items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value

    def hooked(world: World) -> None:
        it = world.extra["it"]
        if name == "cupy":
            it.begin_capture()
            it.end_capture()
        else:
            it.begin_building()
            it.end_building()

    def block(world: World) -> None:
        with module.capture(world.extra["it"], "global", driver=world.facade):
            pass

    def recover(world: World) -> None:
        it = world.extra["it"]
        if name == "cupy":
            if it.is_capturing():
                it.end_capture()
        elif it.is_building:
            it.end_building()

    def watched(world: World) -> list[str]:
        found = []
        if len(module.windows):
            found.append(f"{len(module.windows)} window(s) still recorded")
        if getattr(module.windows, "in_flight", list)():
            found.append("a begin still in flight")
        return found

    return (
        Cycle(f"{name} hooks", setup, hooked, recover, teardown, watched),
        Cycle(f"{name} capture()", setup, block, recover, teardown, watched),
    )


def _torch_cycle(split: bool) -> Cycle:
    """torch.cuda.synchronize and a CUDAGraph capture through the installed hooks (fake torch,
    in torch 2.11's shape or with the newer split end)."""
    from capsafe.integrations import torch as module

    def setup(world: World) -> None:
        from fake_torch import fake_torch

        world.extra["saved"] = sys.modules.get("torch")
        torch = sys.modules["torch"] = fake_torch(world.backend, split=split)
        module.install(cast(Backend, world.facade))
        world.extra["torch"], world.extra["graph"] = torch, torch.cuda.CUDAGraph()
        world.extra["stream"] = torch.cuda.Stream()

    def teardown(world: World) -> None:
        module.windows.release_all()
        getattr(module.windows, "_beginning", {}).clear()
        module.uninstall()
        if world.extra["saved"] is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = world.extra["saved"]

    def hooked(world: World) -> None:
        torch, graph = world.extra["torch"], world.extra["graph"]
        torch.cuda.synchronize()  # a shared section, as torch.cuda.graph makes before it begins
        with torch.cuda.stream(world.extra["stream"]):
            graph.capture_begin(capture_error_mode="global")
            graph.capture_end()

    def recover(world: World) -> None:
        torch, graph = world.extra["torch"], world.extra["graph"]
        with torch.cuda.stream(world.extra["stream"]):
            if torch.cuda.is_current_stream_capturing():
                graph.capture_end()

    def watched(world: World) -> list[str]:
        found = []
        if len(module.windows):
            found.append(f"{len(module.windows)} window(s) still recorded")
        if module.windows.in_flight():
            found.append("a begin still in flight")
        return found

    name = "torch hooks (split end)" if split else "torch hooks"
    return Cycle(name, setup, hooked, recover, teardown, watched)


CYCLES = (
    GATE_CAPTURE,
    FACADE_CAPTURE,
    GATED_CALL,
    *_integration_cycles("cupy"),
    *_integration_cycles("cuda_core"),
    _torch_cycle(split=False),
    _torch_cycle(split=True),
)
