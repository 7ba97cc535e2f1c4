"""cuda.core through the capture gate.

- `GatedMemoryResource(inner)`: a `MemoryResource` that allocates and frees
  through `inner` (the device's default, stream-ordered resource) inside the
  gate's shared side. A buffer the capturing thread frees inside its own window
  is released at the window's end, unless it was allocated inside that window
  (then its free is captured with it, as cuda.core would do).
- `capture(builder, mode)`: `GraphBuilder.begin_building` .. `end_building` as a
  `with` block holding the gate's exclusive side.
- `install()`: every `Device.memory_resource` (the default one and any a user
  sets) is seen through a `GatedMemoryResource`, and `GraphBuilder.begin_building`
  / `end_building` / `close` hold the exclusive side as `capture()` does.
  `GraphBuilder` is a Cython extension type whose attributes Python cannot set,
  so the methods are replaced in the type's own dictionary (CPython only, see
  `_patch`): every Python-level call sees them.

cuda.core is imported by these calls only, never by importing this module.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from typing import Any

from capsafe import driver as _driver
from capsafe.backend import Backend
from capsafe.errors import UsageError, raised_here
from capsafe.handles import CaptureMode, StreamKind

from ._capture_windows import Windows, exclusive, gate_of
from ._installer import Installer
from ._patch import Patches

windows = Windows()  # builders that are building, by id


def _core() -> tuple[Any, Any]:
    """(the cuda.core module with Device and MemoryResource, the GraphBuilder class)."""
    try:
        core = importlib.import_module("cuda.core")
        if not hasattr(core, "Device"):  # cuda.core before 1.0 keeps its API here
            core = importlib.import_module("cuda.core.experimental")
    except ImportError:
        core = importlib.import_module("cuda.core.experimental")
    builder = getattr(core, "GraphBuilder", None)
    if builder is None:  # cuda.core 1.x: the graph API has its own module
        builder = importlib.import_module(f"{core.__name__}.graph").GraphBuilder
    return core, builder


def _stream_handle(stream: Any) -> int:
    stream = getattr(stream, "stream", stream)  # a GraphBuilder orders work on its stream
    return 0 if stream is None else int(stream.handle)


def _alloc_call(stream: Any) -> str:
    # The hazard-table name of a stream-ordered allocation or free on `stream`.
    return "memset_async_legacy" if _stream_handle(stream) in (0, 1) else "mem_alloc_async_other"


def _resource_class() -> type:
    return _resource_class_for(_core()[0])


@functools.cache
def _resource_class_for(core: Any) -> type:
    """The gated resource class over this cuda.core module's `MemoryResource`."""

    class GatedMemoryResource(core.MemoryResource):  # type: ignore[misc]
        """`inner`'s allocations and frees, each inside the gate's shared side."""

        def __init__(self, inner: Any, driver: Backend | None = None) -> None:
            self.inner = inner
            self._gate = gate_of(driver if driver is not None else _driver.get())
            self._buffers: dict[int, Any] = {}  # our pointer -> inner's buffer (owns it)
            # pointer -> `windows.opened` when the capturing thread allocated it inside its window
            self._in_window: dict[int, int] = {}

        def allocate(self, size: int, stream: Any = None) -> Any:
            gate = self._gate
            if gate is None:
                buffer = self.inner.allocate(size, stream=stream)
            else:
                gate.enter(_alloc_call(stream))
                try:
                    buffer = self.inner.allocate(size, stream=stream)
                finally:
                    gate.exit()
            ptr = int(buffer.handle)
            self._buffers[ptr] = buffer
            if gate is not None and gate.owned_by_current_thread():
                self._in_window[ptr] = windows.opened
            return core.Buffer.from_handle(ptr, size, mr=self, stream=stream)

        def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
            key = int(ptr)
            buffer = self._buffers.pop(key, None)
            if buffer is None:
                raise UsageError(f"pointer {key:#x} was not allocated by this resource")
            gate = self._gate
            if gate is None:
                buffer.close(stream)
                return
            # Freed inside the window it was allocated in: captured with it, not deferred.
            inside = self._in_window.pop(key, None) == windows.opened
            if not inside and gate.defer_if_capturing(self._close, buffer, stream):
                return
            self._close(buffer, stream)

        def _close(self, buffer: Any, stream: Any) -> None:
            assert self._gate is not None
            self._gate.enter(_alloc_call(stream))
            try:
                buffer.close(stream)
            finally:
                self._gate.exit()

        @property
        def is_device_accessible(self) -> bool:
            return bool(self.inner.is_device_accessible)

        @property
        def is_host_accessible(self) -> bool:
            return bool(self.inner.is_host_accessible)

        @property
        def is_managed(self) -> bool:
            return bool(getattr(self.inner, "is_managed", False))

        @property
        def device_id(self) -> int:
            return int(self.inner.device_id)

    return GatedMemoryResource


def GatedMemoryResource(inner: Any, driver: Backend | None = None) -> Any:
    """A gated view of `inner` (see the module doc); the class is built on first use."""
    return _resource_class()(inner, driver)


def _kind(builder: Any) -> StreamKind:
    stream = builder.stream
    return (
        StreamKind.NONBLOCKING if getattr(stream, "is_nonblocking", True) else StreamKind.BLOCKING
    )


def _begin(driver: Backend, builder: Any, mode: str, begin: Any, close: Any, hooked: bool) -> Any:
    """`begin(builder, mode)` in a window; when this raises, nothing is building or held."""
    ours = CaptureMode.parse(mode)
    label = f"cuda.core GraphBuilder {id(builder):#x} ({ours})"
    abort = functools.partial(close, builder)  # closing a builder ends its capture
    try:
        result = windows.begin(
            id(builder),
            lambda into: exclusive(driver, ours, lambda: _kind(builder), label, into),
            functools.partial(begin, builder, mode),
            abort,
            lambda: builder.is_building,
            hooked=hooked,
        )
    except BaseException as exc:
        if raised_here(exc, Windows.begin):  # it landed after the window opened: close it again
            windows.undo_begin(id(builder), abort, lambda: builder.is_building)
        raise
    return result


def _building(builder: Any) -> Callable[[], bool]:
    return lambda: bool(builder.is_building)


class _Installation:
    def __init__(self, core: Any, builder_cls: Any, driver: Backend) -> None:
        self.patches = Patches()
        device_cls = core.Device
        prop = device_cls.__dict__["memory_resource"]
        views: dict[int, Any] = {}  # id(inner) -> its gated view (inner kept alive by the view)

        def gated_view(device: Any) -> Any:
            inner = prop.fget(device)
            if isinstance(inner, _resource_class()):
                return inner
            view = views.get(id(inner))
            if view is None or view.inner is not inner:
                view = views[id(inner)] = GatedMemoryResource(inner, driver)
            return view

        self.patches.replace(device_cls, "memory_resource", property(gated_view, prop.fset))
        self.original_begin = builder_cls.__dict__["begin_building"]
        self.original_end = builder_cls.__dict__["end_building"]
        self.original_close = builder_cls.__dict__["close"]
        begin, end, close = self.original_begin, self.original_end, self.original_close

        def begin_building(builder: Any, mode: str = "relaxed") -> Any:
            try:
                result = _begin(driver, builder, mode, begin, close, True)
            except BaseException as exc:
                if raised_here(exc, _begin):  # it landed after the window opened: close it again
                    abort = functools.partial(close, builder)
                    windows.undo_begin(id(builder), abort, lambda: builder.is_building)
                raise
            return result

        # Inline, not a helper: a signal at a helper's entry would end nothing.
        def end_building(builder: Any) -> Any:
            try:
                result = windows.end(id(builder), partial(end, builder), _building(builder))
            except BaseException as exc:
                if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
                    windows.finish(id(builder), partial(end, builder), _building(builder))
                raise
            return result

        def close_builder(builder: Any) -> Any:
            try:
                result = windows.end(id(builder), partial(close, builder))
            except BaseException as exc:
                if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
                    windows.finish(id(builder), partial(close, builder), _building(builder))
                raise
            return result

        self.patches.replace(builder_cls, "begin_building", begin_building)
        self.patches.replace(builder_cls, "end_building", end_building)
        self.patches.replace(builder_cls, "close", close_builder)
        windows.hooked = True

    def undo(self) -> None:
        self.patches.restore()


def install(driver: Backend | None = None) -> bool:
    """Gate cuda.core's device memory and graph building; False when already installed."""
    return _installer.install(driver)


def _hook(driver: Backend) -> _Installation:
    core, builder_cls = _core()
    return _Installation(core, builder_cls, driver)


_installer = Installer(
    "cuda_core",
    windows,
    _hook,
    still_open="graph builder(s) still building",
    end_first="end the graph builder",
)
uninstall = _installer.uninstall
is_installed = _installer.is_installed
installed = _installer.installed


@contextmanager
def capture(
    builder: Any, mode: CaptureMode | str = CaptureMode.RELAXED, *, driver: Backend | None = None
) -> Iterator[Any]:
    """`builder.begin_building(mode)` .. `end_building()` holding the gate's exclusive side.

        with capsafe.integrations.cuda_core.capture(device.create_graph_builder()) as gb:
            launch(gb, config, kernel, *args)
        graph = gb.complete()

    When the body raises, building is still ended (closing the builder if the
    capture was invalidated) and the body's error propagates.
    """
    _, builder_cls = _core()
    driver = driver if driver is not None else _driver.get()
    state = _installer.current
    begin = state.original_begin if state is not None else builder_cls.begin_building
    end = state.original_end if state is not None else builder_cls.end_building
    close = state.original_close if state is not None else builder_cls.close
    try:
        _begin(driver, builder, CaptureMode.parse(mode).value, begin, close, False)
    except BaseException as exc:
        if raised_here(exc, _begin):  # it landed after the window opened: close it again
            abort = functools.partial(close, builder)
            windows.undo_begin(id(builder), abort, lambda: builder.is_building)
        raise
    try:
        yield builder
    except BaseException:
        with suppress(Exception):  # the body's error is the story; close ends the capture
            try:
                windows.end(id(builder), partial(close, builder))
            except BaseException as exc:
                if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
                    windows.finish(id(builder), partial(close, builder), _building(builder))
                raise
        raise
    try:
        windows.end(id(builder), partial(end, builder), _building(builder))
    except BaseException as exc:
        if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
            windows.finish(id(builder), partial(end, builder), _building(builder))
        raise
