"""capsafe.integrations.cupy against a small fake of CuPy's hook points, on the sim backend.

The fake `cupy` module (injected into sys.modules) has what the integration
touches: `cuda.MemoryPool` over a base allocator, `PythonFunctionAllocator`,
`set_allocator`/`get_allocator`, the pinned pool and its setter, a plain-Python
`_BaseStream` whose `begin_capture`/`end_capture` call the (raw, ungated) sim
driver the way CuPy calls the runtime, and `runtime.malloc`/`free`/`CUDARuntimeError`
over the raw sim as CuPy's runtime module sits over the driver.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from capsafe.driver import GatedDriver
from capsafe.errors import CaptureInvalidated, CudaError, UsageError
from capsafe.gate import CaptureGate
from capsafe.handles import CaptureMode, DevicePtr, Graph
from capsafe.integrations import cupy as integration
from capsafe.sim import SimBackend

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"cudaError {status}")


class _Memory:
    """PythonFunctionAllocator's memory: malloc at creation, free on `release()`."""

    def __init__(
        self, size: int, malloc: Callable[[int, int], int], free: Callable[[int, int], None]
    ) -> None:
        self.size, self._free = size, free
        self.ptr = malloc(size, 0)

    def release(self) -> None:
        if self.ptr:
            self._free(self.ptr, 0)
            self.ptr = 0


class PythonFunctionAllocator:
    def __init__(self, malloc: Callable[[int, int], int], free: Callable[[int, int], None]) -> None:
        self._malloc, self._free = malloc, free

    def malloc(self, size: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(mem=_Memory(size, self._malloc, self._free), ptr=None)


class MemoryPool:
    """Caches released blocks by size; grows through its base allocator (thread-safe, as CuPy's)."""

    def __init__(self, allocator: Any = None) -> None:
        self._allocator = allocator
        self._free: dict[int, list[_Memory]] = {}
        self._lock = threading.Lock()

    def malloc(self, size: int) -> _Memory:
        with self._lock:
            cached = self._free.get(size)
            if cached:
                return cached.pop()
        mem: _Memory = self._allocator(size).mem
        return mem

    def free(self, mem: _Memory) -> None:
        with self._lock:
            self._free.setdefault(mem.size, []).append(mem)

    def free_all_blocks(self, stream: object = None) -> None:
        with self._lock:
            mems, self._free = [m for ms in self._free.values() for m in ms], {}
        for mem in mems:
            mem.release()


class PinnedMemoryPointer:
    def __init__(self, mem: _Memory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class PinnedMemoryPool:
    def __init__(self, allocator: Any) -> None:
        self._alloc = allocator
        self._free: list[_Memory] = []

    def malloc(self, size: int) -> PinnedMemoryPointer:
        return PinnedMemoryPointer(self._free.pop() if self._free else self._alloc(size).mem, 0)

    def free_all_blocks(self) -> None:
        self._free.clear()


def fake_cupy(sim: SimBackend) -> Any:
    """A fresh fake `cupy` whose streams capture on `sim` directly (no gate)."""

    def primary() -> None:  # the runtime makes device 0's primary context current on first use
        if sim.ctx_get_current() is None:
            sim.ctx_set_current(sim.primary_ctx_retain(sim.device_get(0)))

    def free(ptr: int) -> None:
        primary()
        sim.mem_free(DevicePtr(ptr))

    def malloc(size: int) -> int:  # cudaMalloc over the raw driver, as CuPy's runtime module does
        primary()
        try:
            return sim.mem_alloc(size).value
        except CudaError as exc:
            if exc.result == "CUDA_ERROR_OUT_OF_MEMORY":
                raise CUDARuntimeError(2) from exc
            raise

    runtime = types.SimpleNamespace(
        malloc=malloc,
        free=free,
        streamCaptureModeGlobal=0,
        streamCaptureModeThreadLocal=1,
        streamCaptureModeRelaxed=2,
        errorMemoryAllocation=2,
        CUDARuntimeError=CUDARuntimeError,
    )
    modes = {0: CaptureMode.GLOBAL, 1: CaptureMode.THREAD_LOCAL, 2: CaptureMode.RELAXED}

    class _BaseStream:
        def __init__(self, non_blocking: bool = True) -> None:
            self.handle = sim.stream_create(nonblocking=non_blocking)
            self.ptr = self.handle.value
            self.is_non_blocking = non_blocking
            self.end_error: BaseException | None = None
            self.refuse_end: BaseException | None = None

        def begin_capture(self, mode: int | None = None) -> None:
            sim.stream_begin_capture(self.handle, modes[2 if mode is None else mode])

        def end_capture(self) -> Graph:
            if self.refuse_end is not None:  # the driver refuses: the capture stays open
                raise self.refuse_end
            graph = sim.stream_end_capture(self.handle)
            if self.end_error is not None:
                raise self.end_error
            return graph

        def is_capturing(self) -> bool:
            return sim.stream_is_capturing(self.handle) == "active"

        def __enter__(self) -> _BaseStream:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    class Stream(_BaseStream):
        pass

    state: dict[str, Any] = {}

    def set_allocator(allocator: object = None) -> None:
        if state.get("thread_local"):
            raise ValueError("set_allocator() cannot be called within using_allocator context")
        state["allocator"] = allocator

    def set_pinned_memory_allocator(allocator: object = None) -> None:
        state["pinned"] = allocator

    default_pool = MemoryPool(lambda size: None)
    default_pinned = PinnedMemoryPool(lambda size: None)
    cuda = types.SimpleNamespace(
        Stream=Stream,
        MemoryPool=MemoryPool,
        PinnedMemoryPool=PinnedMemoryPool,
        PinnedMemoryPointer=PinnedMemoryPointer,
        PythonFunctionAllocator=PythonFunctionAllocator,
        set_allocator=set_allocator,
        get_allocator=lambda: state["allocator"],
        set_pinned_memory_allocator=set_pinned_memory_allocator,
        get_device_id=lambda: 0,
        runtime=runtime,
    )
    module: Any = types.ModuleType("cupy")  # CuPy has no types: its fake neither
    module.cuda = cuda
    module._default_memory_pool = default_pool
    module._default_pinned_memory_pool = default_pinned
    module.state = state
    set_allocator(default_pool.malloc)
    set_pinned_memory_allocator(default_pinned.malloc)
    return module


@pytest.fixture
def cupy(sim_backend: SimBackend, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    fake = fake_cupy(sim_backend)
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    yield fake
    if integration.is_installed():
        integration.windows.release_all()
        integration.uninstall()


@pytest.fixture
def facade(sim_backend: SimBackend) -> Any:
    """A GatedDriver, used both as the Backend it stands for (driver.get() casts it so)
    and for its gate: Any, as neither type alone says both."""
    return GatedDriver(sim_backend, CaptureGate())


def used(sim: SimBackend) -> int:
    free, total = sim.mem_get_info()
    return total - free


def test_install_is_idempotent_and_uninstall_restores_everything(cupy: Any, facade: Any) -> None:
    begin, end = cupy.cuda.Stream.begin_capture, cupy.cuda.Stream.end_capture
    allocator = cupy.cuda.get_allocator()
    pool, pinned = cupy._default_memory_pool, cupy._default_pinned_memory_pool

    assert integration.install(facade) is True
    ours = cupy._default_memory_pool
    assert integration.install(facade) is False  # a second install changes nothing
    assert cupy._default_memory_pool is ours is not pool
    assert cupy.cuda.get_allocator() == ours.malloc
    assert cupy.state["pinned"] == cupy._default_pinned_memory_pool.malloc
    assert cupy.cuda.Stream.begin_capture is not begin

    assert integration.uninstall() is True
    assert integration.uninstall() is False
    assert cupy.cuda.Stream.begin_capture is begin and cupy.cuda.Stream.end_capture is end
    assert cupy.cuda.get_allocator() is allocator
    assert cupy._default_memory_pool is pool and cupy._default_pinned_memory_pool is pinned
    assert cupy.state["pinned"] == pinned.malloc


def test_an_install_cupy_refuses_changes_nothing(cupy: Any, facade: Any) -> None:
    begin, allocator = cupy.cuda.Stream.begin_capture, cupy.cuda.get_allocator()
    cupy.state["thread_local"] = True  # inside `cupy.cuda.using_allocator`
    with pytest.raises(ValueError, match="using_allocator"):
        integration.install(facade)
    assert not integration.is_installed()
    assert cupy.cuda.Stream.begin_capture is begin and cupy.cuda.get_allocator() is allocator


def test_installed_block_undoes_only_its_own_install(cupy: Any, facade: Any) -> None:
    with integration.installed(facade):
        assert integration.is_installed()
    assert not integration.is_installed()
    integration.install(facade)
    with integration.installed(facade):
        pass
    assert integration.is_installed()  # the block did not install it, so it leaves it


def test_capture_holds_the_gate_and_end_capture_releases_it_also_when_it_raises(
    cupy: Any, facade: Any
) -> None:
    integration.install(facade)
    stream = cupy.cuda.Stream()
    stream.begin_capture()
    assert facade.gate.stats().open_captures == 1
    stream.end_error = RuntimeError("end_capture failed")
    with pytest.raises(RuntimeError, match="end_capture failed"):
        stream.end_capture()
    assert facade.gate.stats().open_captures == 0
    entered = threading.Event()

    def shared() -> None:
        with facade.gate:
            entered.set()

    threading.Thread(target=shared, daemon=True).start()
    assert entered.wait(5), "the gate stayed closed after end_capture raised"


def test_an_end_capture_the_driver_refuses_keeps_the_gate_until_the_capture_ends(
    cupy: Any, facade: Any
) -> None:
    integration.install(facade)
    stream = cupy.cuda.Stream()
    stream.begin_capture()
    stream.refuse_end = RuntimeError("cudaErrorStreamCaptureWrongThread")
    with pytest.raises(RuntimeError, match="WrongThread"):
        stream.end_capture()
    assert facade.gate.stats().open_captures == 1  # still capturing: still protected
    stream.refuse_end = None
    stream.end_capture()
    assert facade.gate.stats().open_captures == 0


def test_begin_capture_that_raises_gives_the_gate_back(cupy: Any, facade: Any) -> None:
    integration.install(facade)
    stream = cupy.cuda.Stream()
    stream.begin_capture()
    with pytest.raises(Exception, match=r"ILLEGAL_STATE|capturing"):
        stream.begin_capture()  # the stream is already capturing: the driver refuses
    stream.end_capture()
    assert facade.gate.stats().open_captures == 0


def test_pool_growth_goes_through_the_gate_and_pool_hits_do_not(
    cupy: Any, facade: Any, sim_backend: SimBackend
) -> None:
    integration.install(facade)
    allocate = cupy.cuda.get_allocator()
    before, entered = used(sim_backend), facade.gate.stats().shared_entered
    mem = allocate(MiB)
    assert used(sim_backend) == before + MiB
    assert facade.gate.stats().shared_entered == entered + 1  # cuMemAlloc, gated
    cupy._default_memory_pool.free(mem)
    again = allocate(MiB)
    assert again is mem and facade.gate.stats().shared_entered == entered + 1  # a hit


def test_free_on_the_capturing_thread_is_deferred_to_the_end_of_the_capture(
    cupy: Any, facade: Any, sim_backend: SimBackend
) -> None:
    integration.install(facade)
    pool = cupy._default_memory_pool
    pool.free(cupy.cuda.get_allocator()(MiB))
    held = used(sim_backend)
    stream = cupy.cuda.Stream()
    stream.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
    pool.free_all_blocks()  # cuMemFree inside a GLOBAL window would break it
    assert used(sim_backend) == held and facade.gate.stats().deferred == 1
    stream.end_capture()  # no CaptureInvalidated: the free did not run in the window
    assert used(sim_backend) == held - MiB


def test_pinned_memory_goes_through_the_gate(cupy: Any, facade: Any) -> None:
    integration.install(facade)
    entered = facade.gate.stats().shared_entered
    pointer = cupy.state["pinned"](4096)
    assert pointer.ptr != 0 and pointer.mem.size == 4096
    assert facade.gate.stats().shared_entered == entered + 1  # cuMemHostAlloc, gated
    del pointer
    gc.collect()
    assert facade.gate.stats().shared_entered == entered + 2  # cuMemFreeHost at collection


def test_out_of_memory_reads_as_cupys_own_error(cupy: Any, facade: Any) -> None:
    integration.install(facade)
    with pytest.raises(CUDARuntimeError) as caught:
        cupy.cuda.get_allocator()(1 << 50)
    assert caught.value.status == cupy.cuda.runtime.errorMemoryAllocation


class Neighbour:
    """A thread calling cuCtxSynchronize through `facade` until the block ends.

    It breaks any capture of any mode it runs beside; `calls` counts its attempts,
    so a test can wait until it has run inside a window instead of sleeping.
    """

    def __init__(self, facade: Any, sim_backend: SimBackend) -> None:
        self.calls = 0
        self._stop = threading.Event()
        context = sim_backend.ctx_get_current()

        def run() -> None:
            sim_backend.ctx_set_current(context)
            while not self._stop.is_set():
                with contextlib.suppress(CudaError):  # refused while an ungated capture is open
                    facade.ctx_synchronize()
                self.calls += 1

        self._thread = threading.Thread(target=run, name="neighbour", daemon=True)

    def __enter__(self) -> Neighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def run_beside(self, calls: int = 3, timeout: float = 10.0) -> None:
        """Return once the neighbour has made `calls` more calls (or failed the test)."""
        target, deadline = self.calls + calls, time.monotonic() + timeout
        while self.calls < target:
            assert time.monotonic() < deadline, "the neighbour made no calls"
            time.sleep(0.001)


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
def test_a_neighbours_synchronize_breaks_a_cupy_capture_unless_installed(
    cupy: Any, facade: Any, sim_backend: SimBackend, installed: bool
) -> None:
    if installed:
        integration.install(facade)
    stream = cupy.cuda.Stream()
    with Neighbour(facade, sim_backend) as neighbour:
        stream.begin_capture()  # RELAXED, CuPy's default
        if installed:
            time.sleep(0.05)  # the neighbour waits at the gate meanwhile
            stream.end_capture()
        else:
            neighbour.run_beside()
            with pytest.raises(CaptureInvalidated):
                stream.end_capture()


def test_capture_block_for_new_code(cupy: Any, facade: Any, sim_backend: SimBackend) -> None:
    stream = cupy.cuda.Stream()
    with Neighbour(facade, sim_backend):
        with integration.capture(stream, "global", driver=facade) as cap:
            time.sleep(0.05)
        assert cap.graph is not None
        with pytest.raises(LookupError), integration.capture(stream, driver=facade):
            raise LookupError("the body failed")
    assert facade.gate.stats().open_captures == 0
    assert sim_backend.stream_is_capturing(stream.handle) == "none"


def test_uninstall_is_refused_while_a_capture_is_open(cupy: Any, facade: Any) -> None:
    integration.install(facade)
    stream = cupy.cuda.Stream()
    stream.begin_capture()
    with pytest.raises(UsageError, match="still open"):
        integration.uninstall()
    stream.end_capture()
    assert integration.uninstall()


def test_release_all_frees_a_gate_left_by_an_unended_capture(cupy: Any, facade: Any) -> None:
    integration.install(facade)
    stream = cupy.cuda.Stream()
    stream.begin_capture()
    (label,) = integration.windows.release_all()
    assert f"{stream.ptr:#x}" in label
    assert facade.gate.stats().open_captures == 0
    assert integration.windows.release_all() == []


def test_stress_captures_on_many_threads_beside_pool_growth(
    cupy: Any, facade: Any, sim_backend: SimBackend
) -> None:
    # GLOBAL captures on four threads while two threads grow and shrink the pool: every
    # capture survives, no thread starves, and the watchdog (pytest-timeout) sees no hang.
    integration.install(facade)
    context = sim_backend.ctx_get_current()
    pool = cupy._default_memory_pool
    stop, errors, captures, growths = threading.Event(), [], [0] * 4, [0] * 2

    def capturer(n: int) -> None:
        sim_backend.ctx_set_current(context)
        stream = cupy.cuda.Stream()
        try:
            for _ in range(25):
                stream.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
                stream.end_capture()
                captures[n] += 1
        except Exception as exc:
            errors.append(exc)

    def grower(n: int) -> None:  # a fresh thread: the allocator binds the context itself
        allocate = cupy.cuda.get_allocator()
        try:
            while not stop.is_set():
                pool.free(allocate((n + 1) * MiB))
                pool.free_all_blocks()
                growths[n] += 1
        except Exception as exc:
            errors.append(exc)

    growers = [threading.Thread(target=grower, args=(n,), daemon=True) for n in range(2)]
    capturers = [threading.Thread(target=capturer, args=(n,), daemon=True) for n in range(4)]
    for thread in growers + capturers:
        thread.start()
    for thread in capturers:
        thread.join(30)
    stop.set()
    for thread in growers:
        thread.join(30)
    assert not errors, errors
    assert captures == [25] * 4 and min(growths) > 0
    assert facade.gate.stats().open_captures == 0


@pytest.mark.parametrize(
    ("name", "framework"), [("cupy", "cupy"), ("cuda_core", "cuda.core"), ("torch", "torch")]
)
def test_install_without_its_framework_is_one_capsafe_error(
    name: str, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was the import's raw ModuleNotFoundError; it is still an ImportError."""
    from capsafe.errors import CapsafeError
    from capsafe.integrations import module

    for missing in (framework, f"{framework}.experimental"):
        monkeypatch.setitem(sys.modules, missing, None)  # `import` raises ModuleNotFoundError
    integration_module = module(name)
    with pytest.raises(CapsafeError, match=rf"integrations\.{name}\.install\(\): .* not installed"):
        integration_module.install(GatedDriver(SimBackend(), CaptureGate()))
    assert not integration_module.is_installed()
    with pytest.raises(ImportError):
        integration_module.install(GatedDriver(SimBackend(), CaptureGate()))
