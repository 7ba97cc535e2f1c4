"""Neighbour threads: background work that breaks any capture not protected by the gate.

A capture hazard only shows when another thread happens to allocate or
synchronize during the capture window, which in a quiet test run is rare. The
neighbours make it the common case: each thread keeps issuing the calls the
hazard table marks as capture-breaking, through the process-wide driver facade.
An ungated capture in a test then fails fast, while a capture taken through
`capsafe.capture` makes the neighbours wait at the gate and survives.

capsafe is imported only when neighbours start, so a run without
`--capsafe-neighbors` never loads it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("capsafe.harness")

BUFFER_BYTES = 4096
DEFAULT_INTERVAL_S = 0.001
STOP_TIMEOUT_S = 5.0

#: Capture-breaking calls a neighbour cannot issue, and why.
NOT_ISSUED = {
    "stream_query_capturing": "needs the test's own capturing stream",
    "module_unload": "needs a module image, and JIT-loading one per cycle would dominate",
}


class _Kit:
    """One neighbour thread's own stream, event and buffers, plus frees that failed."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.stream = driver.stream_create(nonblocking=True)
        self.event = driver.event_create()
        self.buffer = driver.mem_alloc(BUFFER_BYTES)
        self.host = bytearray(BUFFER_BYTES)
        self.unfreed: list[Any] = []

    def free_later(self, ptr: Any) -> None:
        self.unfreed.append(ptr)

    def retry_frees(self) -> None:
        while self.unfreed:
            self.driver.mem_free(self.unfreed[-1])
            self.unfreed.pop()

    def close(self) -> None:
        """Release what the kit owns; errors are moot at shutdown, so they are dropped."""
        for release in (
            lambda: self.retry_frees(),
            lambda: self.driver.mem_free(self.buffer),
            lambda: self.driver.event_destroy(self.event),
            lambda: self.driver.stream_destroy(self.stream),
        ):
            try:
                release()
            except Exception as exc:
                log.debug("neighbour cleanup: %r", exc)


def _mem_alloc_free(kit: _Kit) -> None:
    ptr = kit.driver.mem_alloc(256)
    try:
        kit.driver.mem_free(ptr)
    except Exception:
        kit.free_later(ptr)
        raise


def _mem_alloc_async_other(kit: _Kit) -> None:
    ptr = kit.driver.mem_alloc_async(256, kit.stream)
    kit.driver.mem_free_async(ptr, kit.stream)


def _host_alloc_free(kit: _Kit) -> None:
    kit.driver.mem_free_host(kit.driver.mem_host_alloc(256))


def _event_sync_other(kit: _Kit) -> None:
    kit.driver.event_record(kit.event, kit.stream)
    kit.driver.event_synchronize(kit.event)


def _stream_sync_other(kit: _Kit) -> None:
    kit.driver.stream_synchronize(kit.stream)


def _ctx_sync(kit: _Kit) -> None:
    kit.driver.ctx_synchronize()


def _memcpy(kit: _Kit) -> None:
    kit.driver.memcpy_htod(kit.buffer, kit.host)
    kit.driver.memcpy_dtoh(kit.host, kit.buffer)


def _memset_sync(kit: _Kit) -> None:
    kit.driver.memset_d8(kit.buffer, 0, BUFFER_BYTES)


def _memset_async_legacy(kit: _Kit) -> None:
    from capsafe.handles import LEGACY_STREAM

    kit.driver.memset_d8_async(kit.buffer, 0, BUFFER_BYTES, LEGACY_STREAM)


#: What each neighbour step does, and the hazard-table calls it issues.
STEPS: tuple[tuple[Callable[[_Kit], None], tuple[str, ...]], ...] = (
    (_mem_alloc_free, ("mem_alloc", "mem_free", "mem_alloc_free")),
    (_mem_alloc_async_other, ("mem_alloc_async_other",)),
    (_host_alloc_free, ("host_alloc", "host_free")),
    (_event_sync_other, ("event_sync_other",)),
    (_stream_sync_other, ("stream_sync_other",)),
    (_ctx_sync, ("ctx_sync",)),
    (_memcpy, ("memcpy_htod", "memcpy_dtoh")),
    (_memset_sync, ("memset_sync",)),
    (_memset_async_legacy, ("memset_async_legacy",)),
)


def issued_calls() -> frozenset[str]:
    """The hazard-table call names the neighbours issue."""
    return frozenset(name for _, names in STEPS for name in names)


class Neighbors:
    """`count` daemon threads cycling through STEPS until `stop()`.

    Driver errors in a step are expected (a test's ungated capture makes the
    neighbours' own calls fail too) and only counted; any other exception ends
    that thread and is reported by `stop()`.
    """

    def __init__(self, count: int, interval: float = DEFAULT_INTERVAL_S) -> None:
        self.count = count
        self.interval = interval
        self.steps = 0
        self.driver_errors = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> str | None:
        """Start the threads; returns why they could not start (None when they did)."""
        try:
            from capsafe import context, driver
            from capsafe.errors import CapsafeError

            context.device(0)
            driver.get()
        except (ImportError, CapsafeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        for n in range(self.count):
            thread = threading.Thread(target=self._run, name=f"capsafe-neighbor-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return None

    def _run(self) -> None:
        from capsafe import context, driver
        from capsafe.errors import CapsafeError

        try:
            context.device(0)
            kit = _Kit(driver.get())
            try:
                self._cycle(kit, CapsafeError)
            finally:
                kit.close()
        except Exception as exc:
            with self._lock:
                self.failures.append(f"{threading.current_thread().name}: {exc!r}")

    def _cycle(self, kit: _Kit, expected: type[Exception]) -> None:
        while not self._stop.is_set():
            for step, _ in STEPS:
                if self._stop.wait(self.interval):
                    return
                try:
                    kit.retry_frees()
                    step(kit)
                    with self._lock:
                        self.steps += 1
                except expected:
                    with self._lock:
                        self.driver_errors += 1

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[str]:
        """Stop and join the threads; returns problems (failed or stuck threads)."""
        self._stop.set()
        stuck = []
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                stuck.append(f"{thread.name} did not stop within {timeout:g} s")
        self._threads.clear()
        return self.failures + stuck
