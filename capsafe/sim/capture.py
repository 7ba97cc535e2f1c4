"""Stream capture and graphs: what a capture records, and which calls break it.

Work put on a capturing stream becomes a node of the graph instead of running.
Before every call the backend asks `apply_hazards` whether the measured table
(`capsafe.hazards`) says that call breaks an open capture; if so the call fails
with the table's CUresult and each capture it broke becomes INVALIDATED; an
INVALIDATED capture nobody ended is looked up in the table's LEFT_OPEN state, so it
keeps refusing calls (another thread's allocation under GLOBAL, anyone's
cuCtxSynchronize) until it is ended, as the H200 does. A call
made in another device's context than the capture's is looked up as
`OTHER_DEVICE`, so the sim applies the table's cross-device rows, no rules of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from capsafe import hazards
from capsafe.errors import cuda_error
from capsafe.handles import CaptureMode, CaptureStatus, Stream, StreamKind
from capsafe.hazards.calls import hazard_call
from capsafe.sim.memory import Alloc, ContextMemory
from capsafe.sim.streams import Node, StreamState


@dataclass(eq=False)
class Capture:
    stream: Stream
    mode: CaptureMode
    owner: int  # thread ident
    context: int  # the value of the capturing stream's context handle
    nodes: list[Node] = field(default_factory=list)
    owned: list[Alloc] = field(default_factory=list)
    status: CaptureStatus = CaptureStatus.ACTIVE


@dataclass(eq=False)
class GraphData:
    """A captured graph, shared by the graph handle and its instantiations."""

    nodes: list[Node]
    owned: list[Alloc]  # stream-ordered allocations made in the capture: freed with the graph
    refs: int = 1

    def unref(self, memory: ContextMemory) -> None:
        self.refs -= 1
        if self.refs == 0:
            free_owned(memory, self.owned)


Captures = dict[int, Capture]  # one context's open captures by stream value, in begin order


def apply_hazards(
    captures: Iterable[Capture], method: str, symbol: str, stream: Stream | None, context: int
) -> None:
    """Fail the call, and invalidate each capture it breaks, per the hazard table.

    A capture already invalidated and not yet ended is looked up as LEFT_OPEN: it keeps
    failing the calls its rules name until `end` (or its stream's destruction) drops it.
    `context` is the value of the context the call runs in (the current one, or the
    primary context a retain or release names).
    """
    me = threading.get_ident()
    fired: tuple[str, hazards.Rule] | None = None
    for capture in captures:
        call = hazard_call(method, stream, capture.stream)
        if call is None:
            continue
        caller = hazards.SAME_THREAD if capture.owner == me else hazards.OTHER_THREAD
        device = hazards.SAME_DEVICE if capture.context == context else hazards.OTHER_DEVICE
        left_open = capture.status is CaptureStatus.INVALIDATED
        state = hazards.LEFT_OPEN if left_open else hazards.ACTIVE
        rule = hazards.rule_for(call, capture.mode, capture.stream.kind, caller, device, state)
        if rule is not None:
            capture.status = CaptureStatus.INVALIDATED
            fired = fired or (call, rule)
    if fired is not None and fired[1].result != hazards.SUCCESS:  # SUCCESS: a silent break
        call, rule = fired
        raise cuda_error(rule.result, symbol, f"{call} during a capture: {rule.why}")


def begin(captures: Captures, ss: StreamState, mode: CaptureMode | str, context: int) -> None:
    symbol = "cuStreamBeginCapture"
    if ss.kind is StreamKind.LEGACY:
        raise cuda_error(hazards.UNSUPPORTED, symbol, "the legacy stream cannot be captured")
    if ss.capture is not None:
        raise cuda_error("CUDA_ERROR_ILLEGAL_STATE", symbol, "the stream is already capturing")
    ss.capture = captures[ss.handle.value] = Capture(
        stream=ss.handle,
        mode=CaptureMode.parse(mode),
        owner=threading.get_ident(),
        context=context,
    )


def end(captures: Captures, memory: ContextMemory, ss: StreamState) -> GraphData:
    """Close the capture on `ss` and return what it recorded, or raise why it cannot."""
    symbol = "cuStreamEndCapture"
    capture = ss.capture
    if capture is None:
        raise cuda_error("CUDA_ERROR_ILLEGAL_STATE", symbol, "the stream is not capturing")
    if capture.mode is not CaptureMode.RELAXED and capture.owner != threading.get_ident():
        raise cuda_error(
            "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
            symbol,
            f"a {capture.mode.value} capture must end on its own thread",
        )
    if capture.status is CaptureStatus.INVALIDATED:
        discard(captures, memory, ss)
        raise cuda_error(hazards.INVALIDATED, symbol, "a call made during the capture broke it")
    ss.capture = None
    del captures[ss.handle.value]
    return GraphData(list(capture.nodes), list(capture.owned))


def discard(captures: Captures, memory: ContextMemory, ss: StreamState) -> None:
    """Drop the capture on `ss` (broken, or its stream destroyed) and what it allocated."""
    capture, ss.capture = ss.capture, None
    captures.pop(ss.handle.value, None)
    if capture is not None:
        free_owned(memory, capture.owned)


def free_owned(memory: ContextMemory, owned: list[Alloc]) -> None:
    for region in owned:
        memory.drop_if_live(region)


def replay(nodes: list[Node]) -> Node:
    """A graph launch: its nodes, in capture order, as one piece of stream work."""
    nodes = list(nodes)

    def node(s: StreamState, seq: int) -> Callable[[], None]:
        runners = [part(s, seq) for part in nodes]  # resolves addresses now

        def run() -> None:
            for runner in runners:
                runner()

        return run

    return node
