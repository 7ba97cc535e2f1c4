"""The primary-context cache: retained once, bound per thread, refused after fork."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from collections import Counter

import pytest

from capsafe import context, driver
from capsafe.backend_sim import SimBackend
from capsafe.context import CudaDevice
from capsafe.errors import BackendUnavailable, ForkedProcessError, UsageError

JOIN_S = 10.0


class CountingSim(SimBackend):
    """A SimBackend that counts primary-context retains and binds per thread."""

    def __init__(self) -> None:
        super().__init__()
        self.retains = 0
        self.binds: Counter[str] = Counter()

    def primary_ctx_retain(self, device):
        self.retains += 1
        return super().primary_ctx_retain(device)

    def ctx_set_current(self, ctx) -> None:
        self.binds[threading.current_thread().name] += 1
        super().ctx_set_current(ctx)


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> CountingSim:
    """capsafe.device() backed by a fresh counting sim and an empty device registry."""
    backend = CountingSim()
    backend.init()
    monkeypatch.setattr(context.driver, "get", lambda: backend)
    monkeypatch.setattr(context, "_devices", {})
    return backend


def _run_threads(target, count: int) -> None:
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


def test_binding_another_device_then_back_rebinds(sim: CountingSim) -> None:
    first = CudaDevice(sim, 0).bind()
    second = CudaDevice(sim, 0).bind()
    first.bind()
    assert sim.binds[threading.current_thread().name] == 3
    assert second.context == first.context


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


def _in_fork(child) -> str:
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
        ("bogus", "UsageError: CAPSAFE_BACKEND='bogus'"),
        ("sim", ""),
    ],
)
def test_backend_variable_in_a_fresh_process(backend: str, expected: str) -> None:
    env = {**os.environ, "CAPSAFE_BACKEND": backend}
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(expected)
    assert len(done.stdout.strip().splitlines()) <= 1
