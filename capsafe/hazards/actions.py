"""One table of hazard actions: each hazard-table row made as real facade calls.

Three places need to *make* the calls the hazard table (`capsafe.hazards`) is
about: the hazard-matrix trial (one call per row, measured), the harness's
neighbour threads and the `capture_race` reproducer (capture-breaking calls in
a loop). They all read `ACTIONS`, so a row cannot be exercised one way in the
measurement and another way in the stress runs.

An action is named by a short stable string (`ctx_sync`, `memcpy_htod_sync`,
`mem_alloc`, ...), the name user reports print ("breaks under: ctx_sync, ...").
Its `row` is the `hazards.CALLS` row it falls under and `methods` the `Backend`
methods its `perform` calls. An action runs in two steps so a trial can keep
its setup out of the capture window:

- `prepare(kit)` creates what the call consumes (the pointer `mem_free` frees)
  and returns it; it runs before the capture begins;
- `perform(kit, prepared)` makes the row's call once and returns what is left
  to release (the pointer `mem_alloc` returned), or None.

`ActionKit.run(action)` does both and releases the leftover at once: the
repeatable form neighbours and reproducers loop over. Anything a failed call
left behind is kept and released by `ActionKit.retry_leftovers()` or `close()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capsafe import hazards
from capsafe.backend import Backend
from capsafe.handles import (
    LEGACY_STREAM,
    CaptureMode,
    Device,
    DevicePtr,
    Event,
    Graph,
    GraphExec,
    HostPtr,
    MemHandle,
    Module,
    Stream,
)

#: A module every driver accepts: PTX ISA 8.0 (CUDA 12.0 and later), sm_90, one empty kernel.
NOOP_PTX = b"""\
.version 8.0
.target sm_90
.address_size 64

.visible .entry capsafe_noop()
{
\tret;
}
\x00"""
NOOP_KERNEL = "capsafe_noop"

BUFFER_BYTES = 1 << 16


@dataclass(frozen=True)
class VmmMapping:
    """A mapped, accessible VMM range: what `vmm_map` makes and `vmm_unmap` takes apart."""

    handle: MemHandle
    va: DevicePtr
    size: int
    mapped: bool = True  # False: reserved and created, the map itself failed


@dataclass(frozen=True)
class FinishedGraph:
    """A graph captured, instantiated, launched and synchronized: what the destroy rows take."""

    graph: Graph | None
    graph_exec: GraphExec | None


Leftover = DevicePtr | HostPtr | Module | Event | Stream | VmmMapping | FinishedGraph | None


class ActionKit:
    """One thread's resources for making hazard calls, plus what failed calls left behind.

    `capturing` is the stream another party captures on (needed only by
    `stream_query_capturing`). The calling thread must have the context bound.
    """

    def __init__(
        self, driver: Backend, *, capturing: Stream | None = None, device: Device | None = None
    ) -> None:
        self.driver = driver
        self.capturing = capturing
        self.device = driver.device_get(0) if device is None else device
        self.leftovers: list[Leftover] = []
        self.granularity = driver.mem_get_allocation_granularity(self.device)
        self.other_stream = driver.stream_create(nonblocking=True)
        self.event = driver.event_create()
        self.ptr = driver.mem_alloc(BUFFER_BYTES)
        self.host = driver.mem_host_alloc(BUFFER_BYTES)

    def run(self, action: HazardAction) -> None:
        """Prepare, perform and release one action; a failure keeps what is left for later."""
        prepared = action.prepare(self) if action.prepare is not None else None
        try:
            leftover = action.perform(self, prepared)
        except BaseException:
            if prepared is not None:
                self.leftovers.append(prepared)
            raise
        if leftover is not None:
            self.leftovers.append(leftover)
        self.retry_leftovers()

    def retry_leftovers(self) -> None:
        """Release what earlier actions left; one that fails again stays for the next try."""
        while self.leftovers:
            release(self, self.leftovers[-1])
            self.leftovers.pop()

    def close(self) -> None:
        """Release leftovers and the kit's own resources; raises the first failure at the end."""
        steps: list[Callable[[], Any]] = [self.driver.ctx_synchronize, self.retry_leftovers]
        for thing in self.owned():
            steps.append(functools.partial(release, self, thing))
        first: Exception | None = None
        for step in steps:
            try:
                step()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def owned(self) -> list[Leftover]:
        return [self.ptr, self.host, self.event, self.other_stream]


def release(kit: ActionKit, thing: Leftover) -> None:
    """Release one leftover with the call that matches its kind."""
    d = kit.driver
    if isinstance(thing, DevicePtr):
        d.mem_free(thing)
    elif isinstance(thing, HostPtr):
        d.mem_free_host(thing)
    elif isinstance(thing, Module):
        d.module_unload(thing)
    elif isinstance(thing, Event):
        d.event_destroy(thing)
    elif isinstance(thing, Stream):
        d.stream_destroy(thing)
    elif isinstance(thing, FinishedGraph):
        if thing.graph_exec is not None:
            d.graph_exec_destroy(thing.graph_exec)
        if thing.graph is not None:
            d.graph_destroy(thing.graph)
    elif isinstance(thing, VmmMapping):
        if thing.mapped:
            d.mem_unmap(thing.va, thing.size)
        d.mem_release(thing.handle)
        d.mem_address_free(thing.va, thing.size)


@dataclass(frozen=True)
class HazardAction:
    """One hazard-table row as facade calls (see the module doc for the two steps)."""

    name: str
    row: str
    methods: tuple[str, ...]
    perform: Callable[[ActionKit, Any], Leftover]
    prepare: Callable[[ActionKit], Leftover] | None = None
    needs_capturing: bool = False

    @property
    def breaks_captures(self) -> bool:
        """True when the row breaks some capture (the calls the gate keeps out of windows)."""
        return self.row in hazards.CAPTURE_BREAKING_CALLS


def _vmm_map(kit: ActionKit, _: Any = None) -> VmmMapping:
    d, size = kit.driver, kit.granularity
    handle = d.mem_create(size, kit.device)
    va = d.mem_address_reserve(size)
    try:
        d.mem_map(va, size, handle)
    except BaseException:
        kit.leftovers.append(VmmMapping(handle, va, size, mapped=False))
        raise
    mapping = VmmMapping(handle, va, size)
    try:
        d.mem_set_access(va, size, kit.device)
    except BaseException:
        kit.leftovers.append(mapping)
        raise
    return mapping


def _vmm_unmap(kit: ActionKit, mapping: VmmMapping) -> None:
    release(kit, mapping)


def _release_retain(kit: ActionKit, _: Any) -> None:
    # The caller holds a reference of its own, so the refcount never reaches zero.
    kit.driver.primary_ctx_release(kit.device)
    kit.driver.primary_ctx_retain(kit.device)


def _event_recorded(kit: ActionKit) -> None:
    kit.driver.event_record(kit.event, kit.other_stream)


def _mem_get_info(kit: ActionKit, _: Any) -> None:
    kit.driver.mem_get_info()


def _stream_query_capturing(kit: ActionKit, _: Any) -> None:
    if kit.capturing is None:
        raise ValueError("stream_query_capturing needs the kit's capturing stream")
    kit.driver.stream_query(kit.capturing)


def _finished_graph(kit: ActionKit) -> FinishedGraph:
    # Made before the capture under test begins, on the kit's own stream.
    d, stream = kit.driver, kit.other_stream
    d.stream_begin_capture(stream, CaptureMode.RELAXED)
    try:
        d.memset_d8_async(kit.ptr, 0, 16, stream)
    finally:
        graph = d.stream_end_capture(stream)
    graph_exec = d.graph_instantiate(graph)
    d.graph_launch(graph_exec, stream)
    d.stream_synchronize(stream)
    return FinishedGraph(graph, graph_exec)


def _destroy_graph(kit: ActionKit, finished: FinishedGraph) -> Leftover:
    assert finished.graph is not None
    kit.driver.graph_destroy(finished.graph)
    return FinishedGraph(None, finished.graph_exec)


def _destroy_graph_exec(kit: ActionKit, finished: FinishedGraph) -> Leftover:
    assert finished.graph_exec is not None
    kit.driver.graph_exec_destroy(finished.graph_exec)
    return FinishedGraph(finished.graph, None)


_N = BUFFER_BYTES

#: Every hazard-table row, once, in the table's order; `tests/core/test_hazard_actions.py`
#: checks the invariants (one action per row, names unique, methods real and mapped).
ACTIONS: tuple[HazardAction, ...] = (
    HazardAction("noop", "noop", (), lambda k, _: None),
    HazardAction("mem_alloc", "mem_alloc", ("mem_alloc",), lambda k, _: k.driver.mem_alloc(_N)),
    HazardAction(
        "mem_free",
        "mem_free",
        ("mem_free",),
        lambda k, p: k.driver.mem_free(p),
        prepare=lambda k: k.driver.mem_alloc(_N),
    ),
    HazardAction(
        "mem_alloc_free",
        "mem_alloc_free",
        ("mem_alloc", "mem_free"),
        lambda k, _: k.driver.mem_free(k.driver.mem_alloc(_N)),
    ),
    HazardAction(
        "mem_alloc_async_other_stream",
        "mem_alloc_async_other",
        ("mem_alloc_async",),
        lambda k, _: k.driver.mem_alloc_async(_N, k.other_stream),
    ),
    HazardAction(
        "host_alloc", "host_alloc", ("mem_host_alloc",), lambda k, _: k.driver.mem_host_alloc(_N)
    ),
    HazardAction(
        "host_free",
        "host_free",
        ("mem_free_host",),
        lambda k, p: k.driver.mem_free_host(p),
        prepare=lambda k: k.driver.mem_host_alloc(_N),
    ),
    HazardAction(
        "module_load",
        "module_load",
        ("module_load_data",),
        lambda k, _: k.driver.module_load_data(NOOP_PTX),
    ),
    HazardAction(
        "module_unload",
        "module_unload",
        ("module_unload",),
        lambda k, p: k.driver.module_unload(p),
        prepare=lambda k: k.driver.module_load_data(NOOP_PTX),
    ),
    HazardAction(
        "event_create", "event_create", ("event_create",), lambda k, _: k.driver.event_create()
    ),
    HazardAction(
        "event_destroy",
        "event_destroy",
        ("event_destroy",),
        lambda k, p: k.driver.event_destroy(p),
        prepare=lambda k: k.driver.event_create(),
    ),
    HazardAction(
        "event_sync_other_stream",
        "event_sync_other",
        ("event_synchronize",),
        lambda k, _: k.driver.event_synchronize(k.event),
        prepare=_event_recorded,
    ),
    HazardAction(
        "stream_create",
        "stream_create",
        ("stream_create",),
        lambda k, _: k.driver.stream_create(nonblocking=True),
    ),
    HazardAction(
        "stream_destroy",
        "stream_destroy",
        ("stream_destroy",),
        lambda k, p: k.driver.stream_destroy(p),
        prepare=lambda k: k.driver.stream_create(nonblocking=True),
    ),
    HazardAction(
        "stream_sync_other",
        "stream_sync_other",
        ("stream_synchronize",),
        lambda k, _: k.driver.stream_synchronize(k.other_stream),
    ),
    HazardAction(
        "stream_query_capturing",
        "stream_query_capturing",
        ("stream_query",),
        _stream_query_capturing,
        needs_capturing=True,
    ),
    HazardAction(
        "ctx_sync", "ctx_sync", ("ctx_synchronize",), lambda k, _: k.driver.ctx_synchronize()
    ),
    HazardAction(
        "memcpy_htod_sync",
        "memcpy_htod",
        ("memcpy_htod",),
        lambda k, _: k.driver.memcpy_htod(k.ptr, k.host.buffer),
    ),
    HazardAction(
        "memcpy_dtoh_sync",
        "memcpy_dtoh",
        ("memcpy_dtoh",),
        lambda k, _: k.driver.memcpy_dtoh(k.host.buffer, k.ptr),
    ),
    HazardAction(
        "memset_sync", "memset_sync", ("memset_d8",), lambda k, _: k.driver.memset_d8(k.ptr, 0, _N)
    ),
    HazardAction(
        "memset_async_legacy",
        "memset_async_legacy",
        ("memset_d8_async",),
        lambda k, _: k.driver.memset_d8_async(k.ptr, 0, _N, LEGACY_STREAM),
    ),
    HazardAction(
        "memset_async_other_stream",
        "memset_async_other_nonblocking",
        ("memset_d8_async",),
        lambda k, _: k.driver.memset_d8_async(k.ptr, 0, _N, k.other_stream),
    ),
    HazardAction("mem_get_info", "mem_get_info", ("mem_get_info",), _mem_get_info),
    HazardAction(
        "primary_ctx_release_retain",
        "primary_ctx_release_retain",
        ("primary_ctx_release", "primary_ctx_retain"),
        _release_retain,
    ),
    HazardAction(
        "vmm_map",
        "vmm_map",
        ("mem_create", "mem_address_reserve", "mem_map", "mem_set_access"),
        _vmm_map,
    ),
    HazardAction(
        "vmm_unmap",
        "vmm_unmap",
        ("mem_unmap", "mem_release", "mem_address_free"),
        _vmm_unmap,
        prepare=_vmm_map,
    ),
    HazardAction(
        "graph_destroy",
        "graph_destroy",
        ("graph_destroy",),
        _destroy_graph,
        prepare=_finished_graph,
    ),
    HazardAction(
        "graph_exec_destroy",
        "graph_exec_destroy",
        ("graph_exec_destroy",),
        _destroy_graph_exec,
        prepare=_finished_graph,
    ),
)

BY_NAME: dict[str, HazardAction] = {action.name: action for action in ACTIONS}
BY_ROW: dict[str, HazardAction] = {action.row: action for action in ACTIONS}
#: The actions whose row breaks some capture: what neighbours and `capture_race --hazards` make.
#: Breaking rows whose preparation is itself a capture (a finished graph's executable to
#: destroy; graph_destroy, prepared the same way, breaks nothing): measured by
#: the hazard-matrix trial, which prepares before the window opens, but never looped
#: by neighbours or reproducers, whose preparation would break captures on its own.
PREPARED_BY_CAPTURE = frozenset({"graph_exec_destroy"})
BREAKING: tuple[HazardAction, ...] = tuple(
    a for a in ACTIONS if a.breaks_captures and a.name not in PREPARED_BY_CAPTURE
)


def names(actions: tuple[HazardAction, ...] | list[HazardAction]) -> str:
    """`ctx_sync, mem_alloc, ...`: how a report lists action kinds."""
    return ", ".join(a.name for a in actions)
