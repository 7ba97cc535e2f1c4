"""Seeing every capture begin and end, without gating or changing anything the caller sees.

The capture hook points capsafe knows, one table (`POINTS`): the facade's
`stream_begin_capture`/`stream_end_capture` (what `capsafe.capture` and every facade
caller use), CuPy's `Stream.begin_capture`/`end_capture`, cuda.core's
`GraphBuilder.begin_building`/`end_building` (and `close`, which ends one too) and
PyTorch's `CUDAGraph.capture_begin`/`capture_end` (which `torch.cuda.graph` calls). The
integrations hook the same methods to gate them; an `Observer` wraps them to be told.

An observer's wrapper calls what was there (the framework's method, or an
integration's gating wrapper installed before it), returns its result and raises its
exception unchanged; the callbacks run after, and an exception of theirs is swallowed.
`hook_loaded()` hooks only the frameworks already imported (it never imports one), so
it is called again whenever more may have been imported. Importing this module imports
no framework and not the facade (only capsafe.errors), so observing costs a process that
captures nothing next to nothing. Used by the harness plugin to know where a test's
captures are (stream, mode, call site, still open).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable, Hashable
from contextlib import suppress
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ._patch import Patches, defining_class

#: The methods of torch's `CUDAGraph` that end a capture (the second only in newer torch);
#: capsafe.integrations.torch gates the same ones.
TORCH_END_METHODS = ("capture_end", "capture_end_pre")


@dataclass(frozen=True)
class Opened:
    """One capture as it began: the key its end is matched by, its stream and mode."""

    key: Hashable
    stream: str
    mode: str


def _hex(value: Any) -> str:
    try:
        return hex(int(value))
    except (TypeError, ValueError):
        return "?"


def _facade(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Opened:
    stream = args[0] if args else kwargs.get("stream")
    mode = args[1] if len(args) > 1 else kwargs.get("mode", "?")
    return Opened(("facade", getattr(stream, "value", id(stream))),
                  _hex(getattr(stream, "value", None)), str(mode))  # fmt: skip


def _facade_end(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    stream = args[0] if args else kwargs.get("stream")
    return ("facade", getattr(stream, "value", id(stream)))


def _cupy(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Opened:
    from .cupy import _mode

    mode = args[0] if args else kwargs.get("mode")
    try:
        named = str(_mode(sys.modules["cupy"], mode))
    except Exception:
        named = str(mode)
    return Opened(("cupy", getattr(obj, "ptr", id(obj))), _hex(getattr(obj, "ptr", None)), named)


def _cupy_end(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    return ("cupy", getattr(obj, "ptr", id(obj)))


def _cuda_core(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Opened:
    mode = args[0] if args else kwargs.get("mode", "relaxed")
    stream = getattr(getattr(obj, "stream", None), "handle", None)
    return Opened(("cuda_core", id(obj)), _hex(stream), str(mode))


def _by_id(name: str) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Hashable]:
    return lambda obj, args, kwargs: (name, id(obj))


def _torch(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Opened:
    from .torch import _mode

    try:  # the stream torch captures on: the current one (a query, no device work)
        stream = _hex(sys.modules["torch"].cuda.current_stream().cuda_stream)
    except Exception:
        stream = "?"
    return Opened(("torch", id(obj)), stream, str(_mode(args, kwargs)))


@dataclass(frozen=True)
class Point:
    """One framework's capture methods: where the class is, and how to read a call."""

    name: str
    places: tuple[tuple[str, str], ...]  # (module, class's dotted path in it): first found
    begin: str
    ends: tuple[str, ...]
    opened: Callable[[Any, tuple[Any, ...], dict[str, Any]], Opened]
    ended: Callable[[Any, tuple[Any, ...], dict[str, Any]], Hashable]


POINTS: tuple[Point, ...] = (
    Point("facade", (("capsafe.driver", "GatedDriver"),), "stream_begin_capture",
          ("stream_end_capture",), _facade, _facade_end),
    # What `driver.raw()` returns: a capture begun past the facade (the facade's own calls
    # reach it too, and are told once: the same key).
    Point("backend-sim", (("capsafe.sim.backend", "SimBackend"),), "stream_begin_capture",
          ("stream_end_capture",), _facade, _facade_end),
    Point("backend-cuda", (("capsafe.backend_cuda", "CudaBackend"),), "stream_begin_capture",
          ("stream_end_capture",), _facade, _facade_end),
    Point("cupy", (("cupy", "cuda.Stream"),), "begin_capture", ("end_capture",), _cupy,
          _cupy_end),
    Point("cuda_core", (("cuda.core", "GraphBuilder"), ("cuda.core.graph", "GraphBuilder"),
                        ("cuda.core.experimental", "GraphBuilder")),
          "begin_building", ("end_building", "close"), _cuda_core, _by_id("cuda_core")),
    Point("torch", (("torch", "cuda.CUDAGraph"),), "capture_begin", TORCH_END_METHODS, _torch,
          _by_id("torch")),
)  # fmt: skip
"""Every capture hook point capsafe knows (the integrations gate these same methods)."""

OnBegin = Callable[[str, Opened, str], None]  # (point name, the capture, call site)
OnEnd = Callable[[str, Hashable, "BaseException | None", "BaseException | None"], None]
"""(point name, key, the exception the end raised, the exception in flight when it ran)."""


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # capsafe
    return tuple(os.path.join(d, "") for d in dirs)


_LIBRARY_DIRS = _library_dirs()
_OWN_FILES = (os.path.abspath(__file__),)


def call_site(frame: FrameType | None, skip: tuple[str, ...] = ()) -> str:
    """`file:line` of the innermost frame that is not library code: the test's own line.

    Library code: the stdlib, installed packages, capsafe, and any directory in `skip`.
    When every frame is library code, the innermost frame outside this module.
    """
    first = None
    dirs = _LIBRARY_DIRS + skip
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if first is None and filename not in _OWN_FILES:
            first = frame
        if not filename.startswith(dirs) and filename not in _OWN_FILES:
            return f"{_short(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    if first is None:
        return "?"
    return f"{_short(os.path.abspath(first.f_code.co_filename))}:{first.f_lineno}"


def _short(path: str) -> str:
    cwd = os.path.join(os.getcwd(), "")
    return path[len(cwd) :] if path.startswith(cwd) else path


class Observer:
    """Told of every capture begin and end through the hook points of loaded frameworks."""

    def __init__(self, on_begin: OnBegin, on_end: OnEnd, skip: tuple[str, ...] = ()) -> None:
        self.on_begin = on_begin
        self.on_end = on_end
        self.skip = skip  # more library code: absolute directories (ending in a separator) or files
        self.patches = Patches()
        self.hooked: set[str] = set()
        self.problems: list[str] = []  # hook points that could not be wrapped, and why

    def hook_loaded(self) -> list[str]:
        """Wrap the hook points of every framework already imported; the names newly hooked."""
        new = []
        for point in POINTS:
            if point.name in self.hooked:
                continue
            cls = _loaded_class(point)
            if cls is None:
                continue
            self.hooked.add(point.name)
            try:
                self._hook(point, cls)
            except Exception as exc:  # a framework version without the method: not observed
                self.problems.append(f"{point.name}: {type(exc).__name__}: {exc}")
                continue
            new.append(point.name)
        return new

    def restore(self) -> None:
        """Put back what was there before `hook_loaded()`."""
        self.patches.restore()
        self.hooked.clear()

    def _hook(self, point: Point, cls: type) -> None:
        begin_owner = defining_class(cls, point.begin)
        original = begin_owner.__dict__[point.begin]
        self.patches.replace(begin_owner, point.begin, self._begin(point, original))
        for name in point.ends:
            try:
                owner = defining_class(cls, name)
            except Exception:
                continue  # `capture_end_pre` exists only in newer torch
            self.patches.replace(owner, name, self._end(point, owner.__dict__[name]))

    def _begin(self, point: Point, original: Any) -> Callable[..., Any]:
        on_begin, skip = self.on_begin, self.skip

        def begin(obj: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(obj, *args, **kwargs)
            with suppress(Exception):  # an observer never changes what the caller sees
                on_begin(point.name, point.opened(obj, args, kwargs),
                         call_site(sys._getframe(1), skip))  # fmt: skip
            return result

        return _like(begin, original)

    def _end(self, point: Point, original: Any) -> Callable[..., Any]:
        on_end = self.on_end

        def end(obj: Any, *args: Any, **kwargs: Any) -> Any:
            in_flight = sys.exc_info()[1]  # a `with` block's exit runs with its exception set
            try:
                result = original(obj, *args, **kwargs)
            except BaseException as exc:
                _tell(on_end, point, obj, args, kwargs, exc, in_flight)
                raise
            _tell(on_end, point, obj, args, kwargs, None, in_flight)
            return result

        return _like(end, original)


def _tell(
    on_end: OnEnd,
    point: Point,
    obj: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    raised: BaseException | None,
    in_flight: BaseException | None,
) -> None:
    with suppress(Exception):
        on_end(point.name, point.ended(obj, args, kwargs), raised, in_flight)


def _like(wrapper: Callable[..., Any], original: Any) -> Callable[..., Any]:
    doc = getattr(original, "__doc__", None)
    if doc:
        wrapper.__doc__ = doc
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__qualname__ = getattr(original, "__qualname__", wrapper.__qualname__)
    return wrapper


def _loaded_class(point: Point) -> type | None:
    """The point's class when its module is already imported (never imports it)."""
    for module, path in point.places:
        found: Any = sys.modules.get(module)
        for part in path.split("."):
            found = getattr(found, part, None)
        if isinstance(found, type):
            return found
    return None
