"""The primary-context cache: retained once, bound per thread, refused after fork."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from capsafe import context, driver
from capsafe._state import reset_for_tests
from capsafe.backend import Backend
from capsafe.context import CudaDevice
from capsafe.errors import BackendUnavailable, CudaError, ForkedProcessError, UsageError
from capsafe.handles import Context, Device
from capsafe.sim import SimBackend

JOIN_S = 10.0


class CountingSim(SimBackend):
    """A SimBackend that counts primary-context retains and binds per thread."""

    def __init__(self, devices: int = 1) -> None:
        super().__init__(devices)
        self.retains = 0
        self.binds: Counter[str] = Counter()

    def primary_ctx_retain(self, device: Device) -> Context:
        self.retains += 1
        return super().primary_ctx_retain(device)

    def ctx_set_current(self, ctx: Context | None) -> None:
        self.binds[threading.current_thread().name] += 1
        super().ctx_set_current(ctx)


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    """Devices a test registered are forgotten after it (after monkeypatch undoes `get`)."""
    yield
    reset_for_tests()


def _use_backend(monkeypatch: pytest.MonkeyPatch, backend: Backend) -> None:
    """Make capsafe.device() hand out devices of `backend`, from an empty registry."""
    backend.init()
    monkeypatch.setattr(driver, "get", lambda: backend)
    reset_for_tests()


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> CountingSim:
    """capsafe.device() backed by a fresh counting sim and an empty device registry."""
    backend = CountingSim()
    _use_backend(monkeypatch, backend)
    return backend


@pytest.fixture
def sim3(monkeypatch: pytest.MonkeyPatch) -> CountingSim:
    """The same with three simulated devices."""
    backend = CountingSim(devices=3)
    _use_backend(monkeypatch, backend)
    return backend


def _run_threads(target: Callable[[], object], count: int) -> None:
    threads = [threading.Thread(target=target, name=f"t{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
        assert not thread.is_alive(), "a thread did not finish: deadlock?"


def test_primary_context_is_retained_once_across_threads(sim: CountingSim) -> None:
    barrier = threading.Barrier(8, timeout=JOIN_S)
    seen = []

    def worker() -> None:
        barrier.wait()
        seen.append(context.device(0))

    _run_threads(worker, 8)
    assert sim.retains == 1
    assert len({id(d) for d in seen}) == 1
    assert context.device(0) is seen[0]


def test_each_thread_binds_once_on_first_use(sim: CountingSim) -> None:
    dev = context.device(0)
    dev.bind()
    dev.make_current()
    assert sim.binds[threading.current_thread().name] == 1
    current = []

    def worker() -> None:
        assert sim.ctx_get_current() is None  # a new thread starts unbound
        dev.bind()
        dev.bind()
        current.append(sim.ctx_get_current())

    _run_threads(worker, 2)
    assert sim.binds["t0"] == sim.binds["t1"] == 1
    assert current == [dev.context, dev.context]


def test_two_handles_of_one_device_share_its_context(sim: CountingSim) -> None:
    first = CudaDevice(sim, 0).bind()
    second = CudaDevice(sim, 0).bind()
    first.bind()
    assert second.context == first.context
    assert sim.binds[threading.current_thread().name] == 1  # already current: no rebind


def test_unbinding_behind_capsafes_back_rebinds_on_the_next_call(sim: CountingSim) -> None:
    """Regression: after another library (or a test fixture's teardown) set the thread's
    current context to NULL, device() trusted a per-thread cache and did not rebind."""
    context.device(0)
    sim.ctx_set_current(None)  # what tests/conftest.py's teardown does
    dev = context.device(0)
    assert sim.ctx_get_current() == dev.context
    assert sim.mem_alloc(256).value  # CUDA_ERROR_INVALID_CONTEXT on the old code
    sim.ctx_set_current(None)
    dev.bind()
    assert sim.mem_get_info()[1] > 0


def test_another_context_made_current_is_replaced_on_bind(sim3: CountingSim) -> None:
    zero = context.device(0)
    other = sim3.primary_ctx_retain(sim3.device_get(2))
    sim3.ctx_set_current(other)  # e.g. another library working on device 2
    assert context.device(0).context == sim3.ctx_get_current() == zero.context
    assert sim3.mem_alloc(256).value > 0


def test_every_ordinal_the_backend_reports_has_its_own_device(sim3: CountingSim) -> None:
    devices = [context.device(n) for n in range(3)]
    assert [d.ordinal for d in devices] == [0, 1, 2]
    assert len({d.context.value for d in devices}) == 3
    assert sim3.retains == 3
    pointers = []
    for dev in devices:  # each bind makes that device's context current, so memory lands there
        dev.bind()
        pointers.append(sim3.mem_alloc(1 << 20))
        assert sim3.ctx_get_current() == dev.context
    for dev, ptr in zip(devices, pointers, strict=True):
        dev.bind()
        sim3.mem_free(ptr)  # only the context that allocated it knows the pointer
    devices[1].bind()
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        sim3.mem_free(pointers[0])
    assert context.device(2) is devices[2]
    assert sim3.binds[threading.current_thread().name] == 11  # each bind above switched device
    with pytest.raises(UsageError, match=r"^device 3 requested but only 3 device\(s\)$"):
        context.device(3)


def test_devices_on_many_threads_bind_each_thread_separately(sim3: CountingSim) -> None:
    barrier = threading.Barrier(6, timeout=JOIN_S)
    errors: list[BaseException] = []

    def worker() -> None:
        ordinal = int(threading.current_thread().name[1:]) % 3
        try:
            barrier.wait()
            for _ in range(50):
                dev = context.device(ordinal)
                assert sim3.ctx_get_current() == dev.context
                sim3.mem_free(sim3.mem_alloc(4096))
                sim3.ctx_set_current(None)  # someone else unbinds between calls
        except BaseException as exc:
            errors.append(exc)

    _run_threads(worker, 6)
    assert errors == []
    assert sim3.retains == 3


@pytest.mark.parametrize("ordinal", ["0", 1.0, True, None])
def test_an_ordinal_that_is_not_an_int_is_one_clear_line(sim: CountingSim, ordinal: Any) -> None:
    context.device(0)
    context.device(1 if sim.device_get_count() > 1 else 0)
    with pytest.raises(UsageError, match=r"^a device ordinal is an int, not "):
        context.device(ordinal)
    assert sim.retains == 1


@pytest.mark.cuda
def test_real_driver_rebinds_after_the_context_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from capsafe.backend_cuda import CudaBackend, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    real = CudaBackend()
    _use_backend(monkeypatch, real)
    for ordinal in range(real.device_get_count()):
        dev = context.device(ordinal)
        real.ctx_set_current(None)
        dev = context.device(ordinal)
        assert real.ctx_get_current() == dev.context
        ptr = real.mem_alloc(1 << 20)  # CUDA_ERROR_INVALID_CONTEXT on the old code
        real.mem_free(ptr)


def test_name_and_compute_capability(sim: CountingSim) -> None:
    dev = context.device()
    assert dev.name == sim.device_get_name(sim.device_get(0))
    major, minor = dev.compute_capability
    assert (major, minor) >= (7, 0)
    assert "CudaDevice 0" in repr(dev)


def test_ordinal_out_of_range_is_one_clear_line(sim: CountingSim) -> None:
    with pytest.raises(UsageError) as refused:
        context.device(3)
    assert str(refused.value) == "device 3 requested but only 1 device(s)"
    with pytest.raises(UsageError, match="device -1 requested"):
        CudaDevice(sim, -1)
    assert sim.retains == 0


def _in_fork(child: Callable[[], str]) -> str:
    """Run `child()` in a forked process; return the line it wrote, with a watchdog."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's teardown
        try:
            os.close(read_end)
            line = child()
        except BaseException as exc:
            line = f"{type(exc).__name__}: {exc}"
        os.write(write_end, line.encode()[:4000] + b"\n")
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], JOIN_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child did not answer in time")
        return os.read(read_end, 8192).decode().strip()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* fork:DeprecationWarning")
def test_forked_child_refuses_the_parents_device(sim: CountingSim) -> None:
    dev = context.device(0)

    def child() -> str:
        try:
            dev.bind()
        except ForkedProcessError as exc:
            fresh = context.device(0)  # the registry starts empty in the child
            return f"refused|{exc}|fresh={fresh is not dev}"
        return "used a dead context"

    answer = _in_fork(child)
    assert answer.startswith("refused|"), answer
    _, message, fresh = answer.split("|")
    assert "before a fork" in message and "use the 'spawn' start method" in message
    assert fresh == "fresh=True"
    assert dev.bind() is dev  # the parent is unaffected


def test_unknown_backend_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"^unknown backend 'gpu'; use one of: cuda, sim, auto$"):
        driver.create_backend("gpu")


def test_cuda_without_a_gpu_is_one_line() -> None:
    from capsafe.backend_cuda import unavailable_reason

    if unavailable_reason() is None:
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendUnavailable) as refused:
        driver.create_backend("cuda")
    assert "\n" not in str(refused.value)
    assert "use CAPSAFE_BACKEND=sim" in str(refused.value)


SNIPPET = """
import capsafe
try:
    capsafe.device(0)
except capsafe.CapsafeError as exc:
    print(type(exc).__name__, exc, sep=": ")
"""


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("bogus", "CAPSAFE_BACKEND='bogus'"),
        ("sim", ""),
    ],
)
def test_backend_variable_in_a_fresh_process(backend: str, expected: str) -> None:
    env = {**os.environ, "CAPSAFE_BACKEND": backend}
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout if expected else done.stdout == ""
    assert len(done.stdout.strip().splitlines()) <= 1
