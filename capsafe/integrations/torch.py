"""PyTorch's CUDA graphs through the capture gate, with no change to the code that uses torch.

`install()` (idempotent; `uninstall()` or the `installed()` context manager undo it)
replaces, on torch's Python layer:

- captures: `torch.cuda.CUDAGraph.capture_begin` takes the gate's exclusive side for
  the capture, in its `capture_error_mode`; the call that ends it (`capture_end`, or
  `capture_end_pre` where torch splits the end) releases it, also when it raises.
  `torch.cuda.graph` and `make_graphed_callables` go through these, so each of their
  captures is a window;
- synchronizing calls, in the gate's shared side, so they wait while another thread
  captures: `torch.cuda.synchronize` (cuCtxSynchronize), `torch.cuda.empty_cache`
  (the caching allocator's cudaFree of its cached blocks), `torch._C._host_emptyCache`
  where torch has it (cudaFreeHost), `torch.cuda.Stream.synchronize` and
  `torch.cuda.Event.synchronize`. `torch.cuda.graph` itself synchronizes and empties
  the cache before it begins, which breaks another thread's capture; installed, it waits.

What it cannot reach: what torch does from C++, above all the caching allocator's own
cudaMalloc when a pool grows and cudaFree when it gives memory back under pressure,
and library workspaces (cuBLAS, cuDNN). A name bound before `install()` (`from
torch.cuda import synchronize`) keeps the original. docs/integrations.md says more.
torch is imported by `install()` only, never by importing this module.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from capsafe.backend import Backend
from capsafe.driver import GatedDriver, breaking_calls
from capsafe.errors import UsageError, raised_here
from capsafe.handles import CaptureMode, StreamKind

from ._capture_windows import Windows, gate_of
from ._installer import Installer
from ._patch import Patches, defining_class
from .observe import TORCH_END_METHODS

#: Torch's Python-level synchronizing calls, by (module path under torch, name), with the
#: hazard-table call each makes. None: named by nothing, so even the measured policy keeps
#: it out of every window (a stream's synchronize may be the capturing stream's own).
FUNCTIONS: tuple[tuple[str, str, str | None], ...] = (
    ("cuda", "synchronize", "ctx_sync"),
    ("cuda", "empty_cache", "mem_free"),
    ("cuda.memory", "empty_cache", "mem_free"),
    ("_C", "_host_emptyCache", "host_free"),
)
METHODS: tuple[tuple[str, str, str | None], ...] = (
    ("Stream", "synchronize", None),
    ("Event", "synchronize", "event_sync_other"),
)

#: The methods of `CUDAGraph` that end a capture (the second only in newer torch): the
#: observer's table holds them.
END_METHODS = TORCH_END_METHODS

windows = Windows()  # captures begun through the hooks, by CUDAGraph


def _torch() -> Any:
    return importlib.import_module("torch")


_MODES = {mode.value: mode for mode in CaptureMode}  # torch's names are capsafe's


def _mode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CaptureMode:
    """The capsafe mode of `capture_begin(pool=None, capture_error_mode="global", ...)`."""
    value = kwargs.get("capture_error_mode", args[1] if len(args) > 1 else "global")
    found = _MODES.get(value) if isinstance(value, str) else None
    if found is not None:
        return found
    try:
        return CaptureMode.parse(value)
    except UsageError:
        return CaptureMode.GLOBAL  # torch will refuse it; the strictest rules meanwhile


def _kind(torch: Any, stream: Any) -> StreamKind:
    """Torch creates its own streams non-blocking; an external one may be either."""
    external = getattr(torch.cuda, "ExternalStream", None)
    if external is not None and isinstance(stream, external):
        return StreamKind.BLOCKING
    return StreamKind.NONBLOCKING


def _module(torch: Any, path: str) -> Any:
    found = torch
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


class _Installation:
    """What `install()` changed, so `uninstall()` can put it back."""

    def __init__(self, torch: Any, driver: Backend) -> None:
        self.patches = Patches()
        try:
            self._hook(torch, driver)
        except BaseException:
            self.patches.restore()  # a torch without one of the hook points: nothing changes
            raise
        windows.hooked = True

    def _hook(self, torch: Any, driver: Backend) -> None:
        graph_cls = torch.cuda.CUDAGraph
        begin_owner = defining_class(graph_cls, "capture_begin")
        begin = begin_owner.__dict__["capture_begin"]
        finish = defining_class(graph_cls, "capture_end").__dict__["capture_end"]
        still_active: Callable[[], bool] = torch.cuda.is_current_stream_capturing

        facade = driver if isinstance(driver, GatedDriver) else None
        gated = gate_of(driver)
        harmful_of: dict[tuple[CaptureMode, StreamKind], frozenset[str]] = {}

        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> None:
            # Every protected capture comes here: one frame, then the window's and the
            # gate's. Nothing is made per capture but the label (and the guard list).
            value = kwargs.get("capture_error_mode", args[1] if len(args) > 1 else "global")
            mode = _MODES.get(value) if isinstance(value, str) else None
            if mode is None:
                mode = _mode(args, kwargs)
            if facade is None or gated is None:  # an ungated facade: the window takes nothing
                harmful, timeout = None, None
            elif facade.policy == "conservative":
                harmful, timeout = None, facade.capture_timeout
            else:  # the stream only under the measured policy: current_stream() costs ~10 us
                kind = _kind(torch, torch.cuda.current_stream())
                harmful = harmful_of.get((mode, kind))
                if harmful is None:
                    harmful = harmful_of[mode, kind] = breaking_calls(mode, kind)
                timeout = facade.capture_timeout
            try:
                windows.begin_hooked(
                    graph,
                    gated,
                    harmful,
                    f"torch CUDAGraph {id(graph):#x} ({mode})",
                    timeout,
                    begin,
                    args,
                    kwargs,
                    finish,
                    still_active,
                )
            except BaseException as exc:
                if raised_here(exc, Windows.begin_hooked):  # it landed after the window opened
                    windows.undo_begin(graph, functools.partial(finish, graph), still_active)
                raise

        capture_begin.__doc__ = begin.__doc__
        self.patches.replace(begin_owner, "capture_begin", capture_begin)
        # Both ends where torch has both: `capture_end` may call `capture_end_pre` (newer
        # torch) or end in C++ itself (2.11); the window closes at whichever ends it first,
        # and a guard released twice is released once.
        for name in END_METHODS:
            if hasattr(graph_cls, name):
                owner = defining_class(graph_cls, name)
                self.patches.replace(owner, name, _ender(owner.__dict__[name], still_active))
        gate = gate_of(driver)
        if gate is not None:  # an ungated facade has nothing to keep out of the windows
            for path, name, call in FUNCTIONS:
                module = _module(torch, path)
                if module is not None and name in vars(module):
                    self.patches.replace(module, name, gate.wrap(vars(module)[name], call))
            for cls_name, name, call in METHODS:
                owner = defining_class(getattr(torch.cuda, cls_name), name)
                self.patches.replace(owner, name, _method(gate.wrap(owner.__dict__[name], call)))

    def undo(self) -> None:
        self.patches.restore()


def _ender(end: Callable[[Any], Any], still_active: Callable[[], bool]) -> Callable[[Any], Any]:
    """`end(graph)`, the method that ends a capture, closing its window (see `Windows.end`)."""

    def end_capture(graph: Any) -> Any:
        # Inline, not a helper: a signal at a helper's entry would end nothing.
        try:
            result = windows.end(graph, end, still_active, (graph,))
        except BaseException as exc:
            if not isinstance(exc, Exception):  # a signal, maybe at windows.end's entry
                windows.finish(graph, functools.partial(end, graph), still_active)
            raise
        return result

    end_capture.__doc__ = end.__doc__
    return end_capture


def _method(gated: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function (a descriptor, so it binds `self`) around a gated callable."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return gated(self, *args, **kwargs)

    return method


_installer = Installer("torch", windows, lambda driver: _Installation(_torch(), driver))


def install(driver: Backend | None = None) -> bool:
    """Route torch's captures and synchronizing calls through the gate of `driver`
    (default `driver.get()`). Returns False when already installed (nothing changes)."""
    return _installer.install(driver)


uninstall = _installer.uninstall
is_installed = _installer.is_installed
installed = _installer.installed
