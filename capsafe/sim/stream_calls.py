"""The simulated driver's stream, event, capture and graph calls.

Work goes on a stream's lazy queue (`streams`) or, on a capturing stream, into the
capture's graph (`capture`); events mark a point in a stream's queue.
"""

from __future__ import annotations

from collections.abc import Callable

from capsafe.errors import cuda_error
from capsafe.handles import CaptureMode, CaptureStatus, Event, Graph, GraphExec, Stream, StreamKind
from capsafe.sim import capture
from capsafe.sim.contexts import SimDriverBase
from capsafe.sim.streams import EventState, StreamState, drain, no_work, nothing


class StreamCalls(SimDriverBase):
    """Streams, captures and graphs, and events."""

    # -- streams and capture ----------------------------------------------------
    def stream_create(self, nonblocking: bool = True) -> Stream:
        with self._lock:
            ctx = self._enter("stream_create", "cuStreamCreate")
            kind = StreamKind.NONBLOCKING if nonblocking else StreamKind.BLOCKING
            handle = Stream(next(self._ids), kind=kind)
            ctx.streams.created[handle.value] = StreamState(handle)
            return handle

    def stream_destroy(self, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("stream_destroy", "cuStreamDestroy", stream)
            ss = self._stream(ctx, stream, "cuStreamDestroy")
            if ss is ctx.streams.legacy:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_HANDLE",
                    "cuStreamDestroy",
                    "the legacy stream cannot be destroyed",
                )
            drain(ss)  # the driver lets queued work finish
            del ctx.streams.created[stream.value]
            if ss.capture is not None:
                capture.discard(ctx.captures, ctx.memory, ss)

    def stream_synchronize(self, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("stream_synchronize", "cuStreamSynchronize", stream)
            ss = self._stream(ctx, stream, "cuStreamSynchronize")
            ss.check_not_invalidated("cuStreamSynchronize")
            ctx.streams.drain_with_implicit(ss)

    def stream_query(self, stream: Stream) -> bool:
        """Polling rule: with work pending, that work runs and the answer is False (NOT_READY)
        once; the next query answers True. A polling loop therefore always terminates."""
        with self._lock:
            ctx = self._enter("stream_query", "cuStreamQuery", stream)
            ss = self._stream(ctx, stream, "cuStreamQuery")
            ss.check_not_invalidated("cuStreamQuery")
            return not ctx.streams.drain_with_implicit(ss)

    def stream_is_capturing(self, stream: Stream) -> CaptureStatus:
        with self._lock:
            ctx = self._enter("stream_is_capturing", "cuStreamIsCapturing", stream)
            ss = self._stream(ctx, stream, "cuStreamIsCapturing")
            return CaptureStatus.NONE if ss.capture is None else ss.capture.status

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        with self._lock:
            ctx = self._enter("stream_wait_event", "cuStreamWaitEvent", stream)
            ss = self._stream(ctx, stream, "cuStreamWaitEvent")
            ev = self._lookup(ctx.events, event, Event, "cuStreamWaitEvent")
            deps = [] if ev.record is None or ev.done else [ev.record]
            ctx.streams.submit(ss, no_work, "cuStreamWaitEvent", deps)

    def stream_begin_capture(self, stream: Stream, mode: CaptureMode) -> None:
        with self._lock:
            ctx = self._enter("stream_begin_capture", "cuStreamBeginCapture", stream)
            ss = self._stream(ctx, stream, "cuStreamBeginCapture")
            capture.begin(ctx.captures, ss, mode, ctx.handle.value)

    def stream_end_capture(self, stream: Stream) -> Graph:
        with self._lock:
            ctx = self._enter("stream_end_capture", "cuStreamEndCapture", stream)
            ss = self._stream(ctx, stream, "cuStreamEndCapture")
            data = capture.end(ctx.captures, ctx.memory, ss)
            handle = Graph(next(self._ids))
            ctx.graphs[handle.value] = data
            return handle

    def graph_instantiate(self, graph: Graph) -> GraphExec:
        with self._lock:
            ctx = self._enter("graph_instantiate", "cuGraphInstantiate")
            data = self._lookup(ctx.graphs, graph, Graph, "cuGraphInstantiate")
            data.refs += 1
            handle = GraphExec(next(self._ids))
            ctx.execs[handle.value] = data
            return handle

    def graph_launch(self, graph_exec: GraphExec, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("graph_launch", "cuGraphLaunch", stream)
            data = self._lookup(ctx.execs, graph_exec, GraphExec, "cuGraphLaunch")
            ss = self._stream(ctx, stream, "cuGraphLaunch")
            ctx.streams.submit(ss, capture.replay(data.nodes), "cuGraphLaunch")

    def graph_exec_destroy(self, graph_exec: GraphExec) -> None:
        with self._lock:
            ctx = self._enter("graph_exec_destroy", "cuGraphExecDestroy")
            data = self._lookup(ctx.execs, graph_exec, GraphExec, "cuGraphExecDestroy")
            del ctx.execs[graph_exec.value]
            data.unref(ctx.memory)

    def graph_destroy(self, graph: Graph) -> None:
        with self._lock:
            ctx = self._enter("graph_destroy", "cuGraphDestroy")
            data = self._lookup(ctx.graphs, graph, Graph, "cuGraphDestroy")
            del ctx.graphs[graph.value]
            data.unref(ctx.memory)

    # -- events ---------------------------------------------------------------------
    def event_create(self, timing: bool = False) -> Event:
        with self._lock:
            ctx = self._enter("event_create", "cuEventCreate")
            handle = Event(next(self._ids))
            ctx.events[handle.value] = EventState()
            return handle

    def event_record(self, event: Event, stream: Stream) -> None:
        with self._lock:
            ctx = self._enter("event_record", "cuEventRecord", stream)
            ev = self._lookup(ctx.events, event, Event, "cuEventRecord")
            ss = self._stream(ctx, stream, "cuEventRecord")

            def record(s: StreamState, seq: int) -> Callable[[], None]:
                ev.record = (s, seq)
                return nothing

            ctx.streams.submit(ss, record, "cuEventRecord")

    def event_synchronize(self, event: Event) -> None:
        with self._lock:
            ctx = self._enter("event_synchronize", "cuEventSynchronize")
            ev = self._lookup(ctx.events, event, Event, "cuEventSynchronize")
            if ev.record is not None and not ev.done:
                drain(*ev.record)

    def event_query(self, event: Event) -> bool:
        """Same polling rule as stream_query: pending work runs, answering False once."""
        with self._lock:
            ctx = self._enter("event_query", "cuEventQuery")
            ev = self._lookup(ctx.events, event, Event, "cuEventQuery")
            if ev.record is None or ev.done:
                return True
            drain(*ev.record)
            return False

    def event_destroy(self, event: Event) -> None:
        with self._lock:
            ctx = self._enter("event_destroy", "cuEventDestroy")
            self._lookup(ctx.events, event, Event, "cuEventDestroy")
            del ctx.events[event.value]
