"""Facade methods named the way the hazard table names calls.

`capsafe.hazards` says which *call* breaks which capture; `hazard_call(method,
stream, capturing)` names the `hazards.CALLS` row a facade method exercises.
The simulated device uses it to apply the table, and the gated driver to decide
which calls take the capture gate's shared side. The calls themselves, made on
purpose, are `capsafe.hazards.actions`; one measured cell is
`capsafe.hazards.trial.run_trial`.
"""

from __future__ import annotations

from capsafe.handles import LEGACY_STREAM, Stream

#: Facade methods whose hazard call does not depend on their arguments.
METHOD_CALLS: dict[str, str] = {
    "mem_alloc": "mem_alloc",
    "mem_free": "mem_free",
    "mem_host_alloc": "host_alloc",
    "mem_free_host": "host_free",
    "module_load_data": "module_load",
    "module_unload": "module_unload",
    "event_create": "event_create",
    "event_destroy": "event_destroy",
    "event_synchronize": "event_sync_other",
    "stream_create": "stream_create",
    "stream_destroy": "stream_destroy",
    "ctx_synchronize": "ctx_sync",
    "memcpy_htod": "memcpy_htod",
    "memcpy_dtoh": "memcpy_dtoh",
    "memset_d8": "memset_sync",
    "mem_get_info": "mem_get_info",
    "primary_ctx_retain": "primary_ctx_release_retain",
    "primary_ctx_release": "primary_ctx_release_retain",
    "mem_create": "vmm_map",
    "mem_address_reserve": "vmm_map",
    "mem_map": "vmm_map",
    "mem_set_access": "vmm_map",
    "mem_unmap": "vmm_unmap",
    "mem_release": "vmm_unmap",
    "graph_destroy": "graph_destroy",
    "graph_exec_destroy": "graph_exec_destroy",
    "mem_address_free": "vmm_unmap",
}

#: Facade methods that put work on their `stream` argument. On the capturing
#: stream that work is captured (no hazard); on another stream it is the table's
#: "async work on another stream" or "work on the legacy stream".
STREAM_WORK_METHODS: frozenset[str] = frozenset(
    {
        "memcpy_htod_async",
        "memcpy_dtoh_async",
        "memset_d8_async",
        "launch_kernel",
        "event_record",
        "stream_wait_event",
        "graph_launch",
        "mem_alloc_async",
        "mem_free_async",
    }
)

#: Facade methods that wait on their `stream` argument.
STREAM_WAIT_METHODS: frozenset[str] = frozenset({"stream_synchronize", "stream_query"})


def hazard_call(
    method: str, stream: Stream | None = None, capturing: Stream | None = None
) -> str | None:
    """The `hazards.CALLS` name of facade `method` on `stream`, seen by a capture on `capturing`.

    None means the table does not concern the call (device queries, capture and
    graph management, or work captured on the capturing stream itself). Without
    `capturing`, `stream` is taken to be some other stream, the conservative view.
    """
    on_capturing = stream is not None and capturing is not None and stream.value == capturing.value
    if method in STREAM_WAIT_METHODS:
        if on_capturing:
            return "stream_query_capturing"
        return "stream_sync_other" if method == "stream_synchronize" else None
    if method in STREAM_WORK_METHODS:
        if on_capturing:
            return None
        if stream is None or stream.value == LEGACY_STREAM.value:
            return "memset_async_legacy"
        if method in ("mem_alloc_async", "mem_free_async"):
            return "mem_alloc_async_other"
        return "memset_async_other_nonblocking"
    return METHOD_CALLS.get(method)
