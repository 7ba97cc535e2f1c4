"""The capture hazard table: which driver call breaks which open capture.

This module is the single source of truth read by the simulated device (to
fail the same calls the hardware fails), by the capture gate (to know which
calls need the shared side), by the hazard-matrix reproducer (to compare a
measurement against it) and by docs/hazards.md. Every rule about a call made
in the capture's own context (`SAME_DEVICE`) was measured on an NVIDIA H200,
driver 580.159.04, cuda-bindings 13.3.1; the raw rows are in docs/data/ and a
test checks that this table reproduces each of them. The rules about a call
made with another device's context current (`OTHER_DEVICE`) are predictions
from CUDA's capture semantics, marked `measured=False` until a 2-GPU machine
measures them (`python -m capsafe_repro.hazard_matrix --cross-device`).

A rule also names the capture *state* it applies to: `ACTIVE` (the capture is
valid) or `LEFT_OPEN` (a call already invalidated it and nobody has ended it
yet). A left-open capture keeps refusing calls until it is ended: first seen on the
H200 with a probe (2026-12-01, docs/data/h200_2026-12-01_left_open/), then every
same-device cell measured by `python -m capsafe_repro.hazard_matrix --left-open`
(2026-12-02, docs/data/h200_2026-12-02/hazard_matrix_left_open.jsonl); the
other-device left-open rules are predictions like the other cross-device ones.

A *call* is named by what it does, not by the driver symbol, because the same
symbol is safe or not depending on its arguments (cuStreamSynchronize on another
stream vs on the capturing one; async work on the legacy stream vs a
non-blocking one).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from capsafe.handles import CaptureMode, StreamKind

SUCCESS = "CUDA_SUCCESS"
UNSUPPORTED = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
IMPLICIT = "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"
INVALIDATED = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"

SAME_THREAD = "same_thread"
OTHER_THREAD = "other_thread"
CALLERS = (SAME_THREAD, OTHER_THREAD)
MODES = tuple(CaptureMode)
CAPTURE_STREAMS = (StreamKind.NONBLOCKING, StreamKind.BLOCKING)
#: Where the call runs relative to the capture: in the capturing stream's context
#: (device A), or with another device's primary context current (device B).
SAME_DEVICE = "same_device"
OTHER_DEVICE = "other_device"
DEVICES = (SAME_DEVICE, OTHER_DEVICE)
#: The state of the capture when the call is made: valid, or already invalidated by an
#: earlier call and not yet ended (cuStreamEndCapture is what ends an invalidated capture).
ACTIVE = "active"
LEFT_OPEN = "left_open"
STATES = (ACTIVE, LEFT_OPEN)

#: Every call the table knows, with the driver symbol it exercises.
CALLS: dict[str, str] = {
    "noop": "(nothing: the control row)",
    "mem_alloc": "cuMemAlloc",
    "mem_free": "cuMemFree",
    "mem_alloc_free": "cuMemAlloc + cuMemFree",
    "mem_alloc_async_other": "cuMemAllocAsync on another stream",
    "host_alloc": "cuMemHostAlloc",
    "host_free": "cuMemFreeHost",
    "module_load": "cuModuleLoadData",
    "module_unload": "cuModuleUnload",
    "event_create": "cuEventCreate",
    "event_destroy": "cuEventDestroy",
    "event_sync_other": "cuEventSynchronize (event recorded on another stream)",
    "stream_create": "cuStreamCreate",
    "stream_destroy": "cuStreamDestroy",
    "stream_sync_other": "cuStreamSynchronize on another stream",
    "stream_query_capturing": "cuStreamQuery on the capturing stream",
    "ctx_sync": "cuCtxSynchronize",
    "memcpy_htod": "cuMemcpyHtoD (synchronous)",
    "memcpy_dtoh": "cuMemcpyDtoH (synchronous)",
    "memset_sync": "cuMemsetD8 (synchronous)",
    "memset_async_legacy": "cuMemsetD8Async on the legacy default stream",
    "memset_async_other_nonblocking": "cuMemsetD8Async on another non-blocking stream",
    "mem_get_info": "cuMemGetInfo",
    "primary_ctx_release_retain": "cuDevicePrimaryCtxRelease + cuDevicePrimaryCtxRetain",
    "vmm_map": "cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess",
    "vmm_unmap": "cuMemUnmap + cuMemRelease + cuMemAddressFree",
    "graph_destroy": "cuGraphDestroy (a finished graph)",
    "graph_exec_destroy": "cuGraphExecDestroy (a finished graph's executable)",
}


@dataclass(frozen=True)
class Rule:
    """Calls that fail with `result` (and invalidate the capture) in the cells listed.

    `result` SUCCESS: the call returns success and still invalidates the capture.
    """

    name: str
    calls: frozenset[str]
    modes: frozenset[CaptureMode]
    streams: frozenset[StreamKind]
    callers: frozenset[str]
    devices: frozenset[str]
    states: frozenset[str]
    result: str
    why: str
    measured: bool  # False: a prediction no hardware run has checked yet


def _rule(
    name: str,
    calls: Iterable[str],
    result: str,
    why: str,
    modes: Iterable[CaptureMode] = MODES,
    streams: Iterable[StreamKind] = CAPTURE_STREAMS,
    callers: Iterable[str] = CALLERS,
    devices: Iterable[str] = (SAME_DEVICE,),
    states: Iterable[str] = (ACTIVE,),
    measured: bool = True,
) -> Rule:
    return Rule(
        name,
        frozenset(calls),
        frozenset(modes),
        frozenset(streams),
        frozenset(callers),
        frozenset(devices),
        frozenset(states),
        result,
        why,
        measured,
    )


#: Allocation and synchronization that GLOBAL mode forbids from any thread and
#: THREAD_LOCAL forbids from the capturing thread; RELAXED allows them.
ALLOCATOR_CALLS = (
    "mem_alloc",
    "mem_free",
    "mem_alloc_free",
    "mem_alloc_async_other",
    "host_alloc",
    "host_free",
    "module_unload",
    "event_sync_other",
    "stream_sync_other",
)
#: Calls that break every capture, in every mode, from any thread.
ALWAYS_CALLS = ("ctx_sync", "stream_query_capturing")
#: Work on the legacy stream, which implicitly synchronizes with blocking streams.
LEGACY_STREAM_CALLS = ("memcpy_htod", "memcpy_dtoh", "memset_sync", "memset_async_legacy")
#: What the capture modes themselves forbid as potentially unsafe: the allocator
#: calls plus cuCtxSynchronize (which in its own context also breaks RELAXED
#: captures, because it waits on the capturing stream; in another device's it does not).
MODE_FORBIDDEN_CALLS = (*ALLOCATOR_CALLS, "ctx_sync")

RULES: tuple[Rule, ...] = (
    _rule(
        "always", ALWAYS_CALLS, UNSUPPORTED, "waits on the device or on the capturing stream itself"
    ),
    _rule(
        "global-any-thread",
        ALLOCATOR_CALLS,
        UNSUPPORTED,
        "GLOBAL mode forbids potentially-synchronizing calls from every thread",
        modes=(CaptureMode.GLOBAL,),
    ),
    _rule(
        "thread-local-same-thread",
        ALLOCATOR_CALLS,
        UNSUPPORTED,
        "THREAD_LOCAL forbids them on the capturing thread only",
        modes=(CaptureMode.THREAD_LOCAL,),
        callers=(SAME_THREAD,),
    ),
    _rule(
        "legacy-implicit",
        LEGACY_STREAM_CALLS,
        IMPLICIT,
        "legacy-stream work implicitly joins a blocking capture stream",
        streams=(StreamKind.BLOCKING,),
    ),
    # Destroying a finished graph's executable (captured, instantiated, launched,
    # synchronized before the capture began): measured on the H200, 2026-12-02, by the
    # hazard matrix. Destroying the graph itself (cuGraphDestroy) broke no capture in any
    # cell, so graph_destroy has no rule and takes no gate.
    _rule(
        "graph-exec-destroy",
        ("graph_exec_destroy",),
        UNSUPPORTED,
        "GLOBAL forbids destroying a graph executable from every thread, THREAD_LOCAL "
        "from the capturing thread",
        modes=(CaptureMode.GLOBAL,),
    ),
    _rule(
        "graph-exec-destroy-thread-local",
        ("graph_exec_destroy",),
        UNSUPPORTED,
        "THREAD_LOCAL forbids it on the capturing thread only",
        modes=(CaptureMode.THREAD_LOCAL,),
        callers=(SAME_THREAD,),
    ),
    # Predicted, not measured: a call made with another device's context current.
    # The legacy stream is per context, so legacy-implicit has no counterpart here.
    _rule(
        "capturing-stream-any-device",
        ("stream_query_capturing",),
        UNSUPPORTED,
        "the query names the capturing stream itself, whichever context is current",
        devices=(OTHER_DEVICE,),
        measured=False,
    ),
    _rule(
        "global-any-device",
        MODE_FORBIDDEN_CALLS,
        UNSUPPORTED,
        "GLOBAL's prohibition of unsafe calls is process-wide, not per context",
        modes=(CaptureMode.GLOBAL,),
        devices=(OTHER_DEVICE,),
        states=STATES,
        measured=False,
    ),
    _rule(
        "thread-local-any-device",
        MODE_FORBIDDEN_CALLS,
        UNSUPPORTED,
        "THREAD_LOCAL's prohibition follows the capturing thread, not its context",
        modes=(CaptureMode.THREAD_LOCAL,),
        callers=(SAME_THREAD,),
        devices=(OTHER_DEVICE,),
        states=STATES,
        measured=False,
    ),
    # A capture another thread's cuCtxSynchronize invalidated and nobody ended (LEFT_OPEN).
    # Measured on the H200, 2026-12-01 (open_invalidated_probe.py): other threads' calls, a
    # non-blocking capture stream. The first matching rule wins, so these come first.
    _rule(
        "left-open-ctx-sync",
        ("ctx_sync",),
        UNSUPPORTED,
        "cuCtxSynchronize still refuses while an invalidated capture is not ended",
        streams=(StreamKind.NONBLOCKING,),
        callers=(OTHER_THREAD,),
        states=(LEFT_OPEN,),
    ),
    _rule(
        "left-open-global-alloc",
        ("mem_alloc",),
        UNSUPPORTED,
        "an unended GLOBAL capture, even invalidated, still forbids allocation process-wide",
        modes=(CaptureMode.GLOBAL,),
        streams=(StreamKind.NONBLOCKING,),
        callers=(OTHER_THREAD,),
        states=(LEFT_OPEN,),
    ),
    # The rest of the left-open cells, measured on the H200 by `hazard_matrix --left-open`
    # (2026-12-02, driver 580.159.04): a left-open capture refuses whatever an active one
    # refuses, with the same result (a query of the capturing stream too: not INVALIDATED).
    _rule(
        "left-open-always",
        ("ctx_sync",),
        UNSUPPORTED,
        "the context keeps a capturing stream until the capture is ended",
        states=(LEFT_OPEN,),
    ),
    _rule(
        "left-open-capturing-stream",
        ("stream_query_capturing",),
        UNSUPPORTED,
        "a query of the capturing stream is refused, as while the capture was valid",
        states=(LEFT_OPEN,),
    ),
    _rule(
        "left-open-capturing-stream-other-device",
        ("stream_query_capturing",),
        UNSUPPORTED,
        "the query names the capturing stream itself, whichever context is current",
        devices=(OTHER_DEVICE,),
        states=(LEFT_OPEN,),
        measured=False,
    ),
    _rule(
        "left-open-global-any-thread",
        (*ALLOCATOR_CALLS, "graph_exec_destroy"),
        UNSUPPORTED,
        "GLOBAL's prohibition lasts until the capture is ended, not until it is invalidated",
        modes=(CaptureMode.GLOBAL,),
        states=(LEFT_OPEN,),
    ),
    _rule(
        "left-open-thread-local-same-thread",
        (*ALLOCATOR_CALLS, "graph_exec_destroy"),
        UNSUPPORTED,
        "THREAD_LOCAL's prohibition on the capturing thread lasts until the capture is ended",
        modes=(CaptureMode.THREAD_LOCAL,),
        callers=(SAME_THREAD,),
        states=(LEFT_OPEN,),
    ),
    _rule(
        "left-open-legacy-implicit",
        LEGACY_STREAM_CALLS,
        IMPLICIT,
        "legacy-stream work still joins a blocking stream that is capturing",
        streams=(StreamKind.BLOCKING,),
        states=(LEFT_OPEN,),
    ),
)

# Every rule names known calls; a typo here would silently make a call "safe".
assert all(
    rule.calls <= CALLS.keys() and rule.devices <= set(DEVICES) and rule.states <= set(STATES)
    for rule in RULES
)


@dataclass(frozen=True)
class Outcome:
    call_result: str  # what the call itself returned
    end_capture: str  # what cuStreamEndCapture returned afterwards

    @property
    def breaks_capture(self) -> bool:
        return self.end_capture != SUCCESS


@functools.cache
def rule_for(
    call: str,
    mode: CaptureMode | str,
    stream: StreamKind | str,
    caller: str,
    device: str = SAME_DEVICE,
    state: str = ACTIVE,
) -> Rule | None:
    """The rule that makes `call` fail in this cell, or None when the call is safe there.

    Cached: the simulated device asks for every call made while a capture is open.
    """
    if call not in CALLS:
        raise KeyError(f"unknown call {call!r}; known: {', '.join(CALLS)}")
    _check_device(device)
    _check_state(state)
    mode, stream = CaptureMode.parse(mode), StreamKind(stream)
    for rule in RULES:
        if (
            call in rule.calls
            and mode in rule.modes
            and stream in rule.streams
            and caller in rule.callers
            and device in rule.devices
            and state in rule.states
        ):
            return rule
    return None


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise KeyError(f"unknown device relation {device!r}; known: {', '.join(DEVICES)}")


def _check_state(state: str) -> None:
    if state not in STATES:
        raise KeyError(f"unknown capture state {state!r}; known: {', '.join(STATES)}")


def expected(
    call: str,
    mode: CaptureMode | str,
    stream: StreamKind | str,
    caller: str,
    device: str = SAME_DEVICE,
    state: str = ACTIVE,
) -> Outcome:
    """What the table predicts for one cell of the hazard matrix.

    A LEFT_OPEN capture was invalidated before the call, so it always ends INVALIDATED.
    """
    rule = rule_for(call, mode, stream, caller, device, state)
    end = INVALIDATED if state == LEFT_OPEN else SUCCESS
    if rule is None:
        return Outcome(SUCCESS, end)
    return Outcome(rule.result, INVALIDATED)


Cell = tuple[str, CaptureMode, StreamKind, str, str, str]


def cells(device: str = SAME_DEVICE, state: str = ACTIVE) -> Iterator[Cell]:
    """Every (call, mode, capture stream, caller, device, state) cell of one device
    relation and capture state."""
    _check_device(device)
    _check_state(state)
    for call in CALLS:
        for mode in MODES:
            for stream in CAPTURE_STREAMS:
                for caller in CALLERS:
                    yield call, mode, stream, caller, device, state


def measured(device: str, state: str = ACTIVE) -> bool:
    """Whether hardware measured every rule about calls in this device relation and state."""
    _check_device(device)
    _check_state(state)
    return all(rule.measured for rule in RULES if device in rule.devices and state in rule.states)


def ever_breaks(call: str) -> bool:
    """True when `call` breaks a capture in at least one cell (the conservative gate set)."""
    return any(call in rule.calls for rule in RULES)


CAPTURE_BREAKING_CALLS: frozenset[str] = frozenset(c for c in CALLS if ever_breaks(c))
