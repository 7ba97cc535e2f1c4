"""`capsafe.capture(stream, mode)`: one capture window as a `with` block.

    with capsafe.capture(stream, "global") as cap:
        drv.memset_d8_async(ptr, 0, n, stream)
    exec_ = cap.instantiate()

Through the gated driver (the default, `driver.get()`), entering takes the
capture gate's exclusive side before cuStreamBeginCapture and leaving releases
it after cuStreamEndCapture, so no capture-breaking call runs on another thread
in between, and teardown this thread requests inside the block runs after it.
When the capture was invalidated anyway, leaving raises `CaptureInvalidated`
naming the stream, mode, how long the window was open and the driver activity
the facade saw during it.
"""

from __future__ import annotations

import time

from capsafe import driver as _driver
from capsafe.backend import Backend
from capsafe.errors import CaptureInvalidated, CudaError, UsageError, raised_here
from capsafe.handles import CaptureMode, Graph, GraphExec, Stream


class Capture:
    """A capture window on one stream; after the block, `graph` holds what was captured."""

    def __init__(
        self,
        stream: Stream,
        mode: CaptureMode | str = CaptureMode.GLOBAL,
        driver: Backend | None = None,
    ) -> None:
        self.stream = stream
        self.mode = CaptureMode.parse(mode)
        self.driver = driver if driver is not None else _driver.get()
        self.graph: Graph | None = None
        self.seconds = 0.0  # how long the window was open
        self._started: float | None = None

    def __enter__(self) -> Capture:
        if self._started is not None:
            raise UsageError("a Capture is single-use; create a new one for the next window")
        self._started = time.monotonic()
        try:
            self.driver.stream_begin_capture(self.stream, self.mode)
        except BaseException as exc:
            if raised_here(
                exc, type(self.driver).stream_begin_capture
            ):  # a signal after the capture began: `with` will not end it
                self._abandon()
            raise
        return self

    def _abandon(self) -> None:
        # End the capture this object began and drop its graph (the facade releases the gate).
        try:
            graph = self.driver.stream_end_capture(self.stream)
        except CudaError:
            return
        self.driver.graph_destroy(graph)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            graph = self.driver.stream_end_capture(self.stream)
        except CaptureInvalidated:
            raise  # the facade's message says why; a body error is chained as context
        except CudaError:
            if exc is None:
                raise
            return  # the body's own error is the story
        except BaseException:
            # A signal: at the end call's entry it ended nothing yet, so end it here.
            self._abandon()
            raise
        finally:
            assert self._started is not None
            self.seconds = time.monotonic() - self._started
        if exc is not None:
            self.driver.graph_destroy(graph)
            return
        self.graph = graph

    def instantiate(self) -> GraphExec:
        """cuGraphInstantiate the captured graph (only after the block ended cleanly)."""
        if self.graph is None:
            raise UsageError("nothing captured yet: instantiate after the `with` block ends")
        return self.driver.graph_instantiate(self.graph)


def capture(
    stream: Stream, mode: CaptureMode | str = CaptureMode.GLOBAL, *, driver: Backend | None = None
) -> Capture:
    """A capture window on `stream` in `mode`, through `driver` (default: `driver.get()`)."""
    return Capture(stream, mode, driver)
