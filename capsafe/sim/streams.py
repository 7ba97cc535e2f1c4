"""The stream scheduler: work queues per stream that run lazily, when something waits.

Each stream holds a FIFO of operations. Nothing runs until a wait (a
synchronize, a query, a synchronous copy) drains the stream, so a missing
synchronization reads stale bytes every time instead of sometimes. The legacy
stream's implicit synchronization with blocking streams is modelled both ways.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from capsafe import hazards
from capsafe.errors import cuda_error
from capsafe.handles import CaptureStatus, Stream, StreamKind

if TYPE_CHECKING:
    from capsafe.sim.capture import Capture

Dependency = tuple["StreamState", int]  # (stream, sequence number it must have reached)


@dataclass(eq=False)
class Op:
    seq: int
    run: Callable[[], None]
    deps: list[Dependency]


#: A piece of stream work before it is placed: called with the stream and the
#: sequence number it gets, it returns the runner. Captured work stays a node.
Node = Callable[["StreamState", int], Callable[[], None]]


def nothing() -> None:
    return None


def no_work(stream: StreamState, seq: int) -> Callable[[], None]:
    """A node that only takes a place in the stream's order (an event wait, an async alloc)."""
    return nothing


@dataclass(eq=False)
class StreamState:
    handle: Stream
    queue: deque[Op] = field(default_factory=deque)
    done_seq: int = 0
    capture: Capture | None = None

    @property
    def kind(self) -> StreamKind:
        return self.handle.kind

    def check_not_invalidated(self, symbol: str) -> None:
        if self.capture is not None and self.capture.status is CaptureStatus.INVALIDATED:
            raise cuda_error(hazards.INVALIDATED, symbol, "the capture on this stream broke")


@dataclass(eq=False)
class EventState:
    record: Dependency | None = None

    @property
    def done(self) -> bool:
        return self.record is None or self.record[0].done_seq >= self.record[1]


def drain(ss: StreamState, upto: int | None = None) -> None:
    """Run `ss`'s pending work in order, up to sequence number `upto` (all by default).

    An operation first waits for its dependencies (other streams up to a
    sequence number). Dependencies always point at work enqueued earlier, so
    this ends; it keeps an explicit stack so long event chains cannot
    exhaust Python's recursion limit.
    """
    stack: list[tuple[StreamState, int | None]] = [(ss, upto)]
    while stack:
        stream, limit = stack[-1]
        if not stream.queue or (limit is not None and stream.queue[0].seq > limit):
            stack.pop()
            continue
        op = stream.queue[0]
        waiting = [(dep, seq) for dep, seq in op.deps if dep.queue and dep.queue[0].seq <= seq]
        if waiting:
            stack.extend(waiting)
            continue
        stream.queue.popleft()
        stream.done_seq = op.seq
        op.run()


class ContextStreams:
    """One context's streams: the legacy stream (value 0) and the created ones.

    `seq` is shared by every context of a backend, so sequence numbers order all
    work the backend was given.
    """

    def __init__(self, seq: itertools.count[int]) -> None:
        self._seq = seq
        self.legacy = StreamState(Stream(0, kind=StreamKind.LEGACY))
        self.created: dict[int, StreamState] = {}

    def all(self) -> Iterator[StreamState]:
        yield self.legacy
        yield from self.created.values()

    def drain_all(self) -> None:
        for ss in list(self.all()):
            drain(ss)

    def implicit_deps(self, ss: StreamState) -> list[Dependency]:
        """The legacy stream waits for blocking streams, and blocking streams for it."""
        if ss.kind is StreamKind.LEGACY:
            return [
                (b, b.queue[-1].seq)
                for b in self.created.values()
                if b.kind is StreamKind.BLOCKING and b.queue
            ]
        if ss.kind is StreamKind.BLOCKING and self.legacy.queue:
            return [(self.legacy, self.legacy.queue[-1].seq)]
        return []

    def drain_with_implicit(self, ss: StreamState) -> bool:
        """Run all of `ss`, and for the legacy stream the blocking work it waits for.

        Returns whether anything was pending.
        """
        deps = self.implicit_deps(ss) if ss.kind is StreamKind.LEGACY else []
        pending = bool(ss.queue or deps)
        for dep_stream, dep_seq in deps:
            drain(dep_stream, dep_seq)
        drain(ss)
        return pending

    def submit(
        self, ss: StreamState, node: Node, symbol: str, deps: Sequence[Dependency] = ()
    ) -> int | None:
        """Capture `node` if `ss` is capturing, else enqueue it; return its sequence number."""
        if ss.capture is not None:
            ss.check_not_invalidated(symbol)
            ss.capture.nodes.append(node)
            return None
        seq = next(self._seq)
        ss.queue.append(Op(seq, node(ss, seq), [*self.implicit_deps(ss), *deps]))
        return seq

    def run_sync(self, node: Node, symbol: str) -> None:
        """A synchronous call: legacy-stream work that completes before returning."""
        seq = self.submit(self.legacy, node, symbol)
        drain(self.legacy, seq)
