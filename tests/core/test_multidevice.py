"""Several devices on the simulated machine: `capsafe.device(n)` for every ordinal, the facade
working in device n's context, and the cross-device rows of the hazard table (issue 14)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

import capsafe
from capsafe import context, driver, hazards
from capsafe._state import reset_for_tests
from capsafe.backend import Backend
from capsafe.errors import CaptureInvalidated, CudaError, ForkedProcessError, UsageError
from capsafe.handles import CaptureMode, StreamKind
from capsafe.hazards.trial import run_trial
from capsafe.sim import SimBackend

pytestmark = pytest.mark.timeout(300)
JOIN_S = 10.0
N = 1 << 16
CROSS = [cell[:5] for cell in hazards.cells(hazards.OTHER_DEVICE)]  # the active state


@pytest.fixture(params=[2, 3], ids=["2-devices", "3-devices"])
def machine(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SimBackend]:
    """The process-wide driver (and so `capsafe.device()`) is a fresh sim with 2 or 3 devices."""
    backend = SimBackend(devices=request.param)
    backend.init()
    reset_for_tests(backend)
    previous = backend.ctx_get_current()
    yield backend
    backend.ctx_set_current(previous)
    reset_for_tests()


def _used(b: Backend) -> int:
    free, total = b.mem_get_info()
    return total - free


# -- capsafe.device(n) and the facade -----------------------------------------------


def test_every_ordinal_is_a_device_with_its_own_context(machine: SimBackend) -> None:
    count = machine.device_get_count()
    devices = [capsafe.device(n) for n in range(count)]
    assert len({d.context.value for d in devices}) == count
    assert all(d.backend is driver.get() for d in devices)  # the gated facade
    with pytest.raises(UsageError) as refused:
        capsafe.device(count)
    assert str(refused.value) == f"device {count} requested but only {count} device(s)"


def test_facade_calls_after_device_n_land_in_device_ns_context(machine: SimBackend) -> None:
    last = machine.device_get_count() - 1
    drv = capsafe.device(last).backend
    ptr = drv.mem_alloc(1 << 20)
    stream = drv.stream_create(nonblocking=True)
    with capsafe.capture(stream, "global") as cap:
        drv.memset_d8_async(ptr, 7, 1 << 20, stream)
    exec_ = cap.instantiate()
    drv.graph_launch(exec_, stream)
    out = bytearray(16)
    drv.memcpy_dtoh_async(out, ptr, stream, 16)
    drv.stream_synchronize(stream)
    assert out == bytes([7] * 16)
    assert _used(drv) >= 1 << 20
    capsafe.device(0)  # the same thread switches device: device 0 knows none of it
    assert _used(drv) == 0
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        drv.stream_synchronize(stream)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.mem_free(ptr)
    capsafe.device(last)  # and back: everything is still there
    drv.graph_exec_destroy(exec_)
    assert cap.graph is not None
    drv.graph_destroy(cap.graph)
    drv.stream_destroy(stream)
    drv.mem_free(ptr)
    assert _used(drv) == 0


def test_test_stream_on_device_1_uses_device_1(machine: SimBackend) -> None:
    with capsafe.TestStream(device=1) as ts:
        ptr = ts.alloc(N)
        ts.fill(ptr, 3)
        assert ts.read(ptr, 4) == b"\x03" * 4
        assert machine.ctx_get_current() == capsafe.device(1).context
        assert _used(machine) >= N
    capsafe.device(0)
    assert _used(machine) == 0


def test_threads_each_bind_their_own_device(machine: SimBackend) -> None:
    count = machine.device_get_count()
    barrier = threading.Barrier(count * 2, timeout=JOIN_S)
    errors: list[BaseException] = []

    def worker(ordinal: int) -> None:
        try:
            barrier.wait()
            for _ in range(20):
                dev = capsafe.device(ordinal)
                assert machine.ctx_get_current() == dev.context
                dev.backend.mem_free(dev.backend.mem_alloc(4096))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i % count,)) for i in range(count * 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
        assert not thread.is_alive(), "a worker did not finish: deadlock?"
    assert errors == []


def _report_refusals(devices: list[context.CudaDevice], conn: Connection) -> None:
    """In the forked child: for each device, whether it refused naming its ordinal."""
    refused = []
    for dev in devices:
        try:
            dev.bind()
            refused.append(False)
        except ForkedProcessError as exc:
            refused.append(f"device {dev.ordinal} was created" in str(exc))
    conn.send(refused)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* fork:DeprecationWarning")
def test_a_forked_child_refuses_every_device_of_its_parent(machine: SimBackend) -> None:
    devices = [capsafe.device(n) for n in range(machine.device_get_count())]
    fork = multiprocessing.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    child = fork.Process(target=_report_refusals, args=(devices, send), daemon=True)
    child.start()
    try:
        assert receive.poll(JOIN_S), "the forked child did not answer in time"
        assert receive.recv() == [True] * len(devices)
    finally:
        child.join(JOIN_S)
        if child.is_alive():
            child.kill()


def test_the_setting_gives_the_process_driver_that_many_devices() -> None:
    code = """
        import capsafe
        from capsafe import driver
        print(driver.get().device_get_count(), capsafe.device(2).ordinal)
        try:
            capsafe.device(3)
        except capsafe.UsageError as exc:
            print(exc)
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSAFE_")}
    env.update(CAPSAFE_BACKEND="sim", CAPSAFE_SIM_DEVICES="3")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["3 2", "device 3 requested but only 3 device(s)"]


# -- the cross-device rows -----------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "mode", "stream", "caller", "device"),
    CROSS,
    ids=["-".join(map(str, c[:4])) for c in CROSS],
)
def test_every_cross_device_cell_follows_the_table(
    call: str, mode: CaptureMode, stream: StreamKind, caller: str, device: str
) -> None:
    backend = SimBackend(devices=2)
    backend.init()
    result = run_trial(backend, call, mode, stream, caller, device, timeout=10)
    assert result.outcome == hazards.expected(call, mode, stream, caller, device)
    broken = result.outcome.breaks_capture
    assert result.capturing_after == ("invalidated" if broken else "active")


def test_cross_device_rows_differ_from_same_device_rows_where_predicted() -> None:
    """Legacy-stream work and cuCtxSynchronize stay in their own context; GLOBAL does not."""

    def breaks(call: str, mode: str, device: str) -> bool:
        return hazards.expected(call, mode, "blocking", "other_thread", device).breaks_capture

    assert breaks("memcpy_htod", "relaxed", hazards.SAME_DEVICE)
    assert not breaks("memcpy_htod", "global", hazards.OTHER_DEVICE)
    assert breaks("ctx_sync", "relaxed", hazards.SAME_DEVICE)
    assert not breaks("ctx_sync", "relaxed", hazards.OTHER_DEVICE)
    assert breaks("ctx_sync", "global", hazards.OTHER_DEVICE)
    assert breaks("mem_alloc", "global", hazards.OTHER_DEVICE)
    assert breaks("stream_query_capturing", "relaxed", hazards.OTHER_DEVICE)


def test_cross_device_rules_are_marked_predictions_until_measured() -> None:
    cross = [r for r in hazards.RULES if hazards.OTHER_DEVICE in r.devices]
    assert cross and not any(r.measured for r in cross)
    active = [r for r in hazards.RULES if hazards.ACTIVE in r.states]
    assert all(r.measured for r in active if hazards.OTHER_DEVICE not in r.devices)
    assert hazards.measured(hazards.SAME_DEVICE) and not hazards.measured(hazards.OTHER_DEVICE)


@pytest.mark.parametrize("mode", hazards.MODES)
@pytest.mark.parametrize("kind", hazards.CAPTURE_STREAMS)
def test_the_measured_gate_policy_keeps_out_cross_device_breakers(
    mode: CaptureMode, kind: StreamKind
) -> None:
    """The gate does not know a call's device, so its harmful set covers every device."""
    for call in hazards.CALLS:
        for device in hazards.DEVICES:
            if hazards.rule_for(call, mode, kind, hazards.OTHER_THREAD, device):
                assert call in driver.breaking_calls(mode, kind), (call, device)


def test_the_sim_applies_cross_device_rows_to_a_capture_on_any_device() -> None:
    b = SimBackend(devices=3)
    b.init()
    contexts = [b.primary_ctx_retain(b.device_get(n)) for n in range(3)]
    b.ctx_set_current(contexts[2])
    stream = b.stream_create(nonblocking=False)
    b.stream_begin_capture(stream, CaptureMode.RELAXED)
    b.ctx_set_current(contexts[0])
    ptr = b.mem_alloc(N)
    b.memset_d8(ptr, 0, N)  # device 0's legacy stream does not join device 2's capture
    b.ctx_synchronize()
    b.ctx_set_current(contexts[2])
    b.graph_destroy(b.stream_end_capture(stream))
    b.stream_begin_capture(stream, CaptureMode.GLOBAL)
    b.ctx_set_current(contexts[1])
    with pytest.raises(CudaError, match=hazards.UNSUPPORTED):
        b.mem_alloc(N)  # GLOBAL forbids it on every device
    b.ctx_set_current(contexts[2])
    with pytest.raises(CaptureInvalidated):
        b.stream_end_capture(stream)


def _capture_while_device_1_allocates(gated: bool) -> tuple[list[str], bool]:
    """A GLOBAL capture on device 0 while another thread allocates on device 1."""
    dev0 = capsafe.device(0)
    drv = driver.get(gated=gated)
    stream = drv.stream_create(nonblocking=True)
    ptr = drv.mem_alloc(N)
    results: list[str] = []
    inside, done = threading.Event(), threading.Event()

    def allocate_on_device_1() -> None:
        capsafe.device(1)
        inside.wait(JOIN_S)
        try:
            drv.mem_free(drv.mem_alloc(N))
            results.append(hazards.SUCCESS)
        except CudaError as exc:
            results.append(exc.result)
        done.set()

    thread = threading.Thread(target=allocate_on_device_1)
    thread.start()
    invalidated = False
    try:
        with capsafe.capture(stream, "global", driver=drv):
            drv.memset_d8_async(ptr, 1, N, stream)
            inside.set()
            done.wait(0.3 if gated else JOIN_S)  # gated: the allocation waits for the gate
    except CaptureInvalidated:
        invalidated = True
    thread.join(JOIN_S)
    assert not thread.is_alive()
    dev0.bind()
    drv.stream_destroy(stream)
    drv.mem_free(ptr)
    return results, invalidated


def test_the_process_wide_gate_protects_a_capture_from_another_devices_allocation(
    machine: SimBackend,
) -> None:
    assert _capture_while_device_1_allocates(gated=False) == ([hazards.UNSUPPORTED], True)
    assert _capture_while_device_1_allocates(gated=True) == ([hazards.SUCCESS], False)


#: A few cross-device cells whose prediction differs from the same-device measurement.
GPU_CELLS = [
    ("mem_alloc", "global", "nonblocking", "other_thread"),
    ("ctx_sync", "relaxed", "nonblocking", "other_thread"),
    ("memcpy_htod", "global", "blocking", "other_thread"),
    ("stream_query_capturing", "relaxed", "nonblocking", "same_thread"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("cell", GPU_CELLS, ids="-".join)
def test_cross_device_prediction_on_the_gpu(cell: tuple[str, str, str, str]) -> None:
    """The predicted rows, on two real GPUs (the full matrix: `--cross-device --compare`)."""
    from capsafe.backend_cuda import CudaBackend

    real = CudaBackend()
    real.init()
    if real.device_get_count() < 2:
        pytest.skip(f"needs 2 devices, this machine has {real.device_get_count()}")
    result = run_trial(real, *cell, hazards.OTHER_DEVICE, timeout=30)
    assert result.outcome == hazards.expected(*cell, hazards.OTHER_DEVICE)
