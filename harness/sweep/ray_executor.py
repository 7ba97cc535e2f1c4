"""`capsafe sweep --executor ray`: each pytest process a Ray task, on one machine or a cluster.

The task runs the very command the local executor would (harness.sweep.executor's
`WatchedProcess`, stall watchdog included) on whichever node Ray picks, so every node
needs this checkout and this Python at the same paths (or a shared filesystem). The
command's records directory and the replay file it reads are mapped to a scratch
directory of the node; as the process runs the task streams back the new lines of its
records and its log, which this side writes into `raw/` exactly where the local
executor's process would have: records stay the only interface, progress counts
finished tests as they stream in.

A task whose worker or node is lost is run once more; lost again, the test it was in
is recorded as crashed, with the node named in the row's message and in the log. The
retry is ours, not Ray's `max_retries`: Ray retries a streaming task by re-running it
and delivering only the items the caller has not seen yet, which would splice the
records of two different runs together.

With `--gpus` each task asks Ray for one GPU and its process is pinned to the device
Ray gave it (a run's xdist workers share it). `ray` is imported only here, and only
by the sweep process: never by the test processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..plugin.gpus import VISIBLE, as_spec
from .executor import (
    SWEEP_SHARED_ENV,
    Chunk,
    Exit,
    Launch,
    WatchedProcess,
    inherited_environ,
    teardowns,
)
from .options import SweepError

RETRIES = 1  # runs of a lost task after the first
STREAM_EVERY_S = 0.0  # a task sends what its process wrote at every watchdog poll (50 ms):
# what a lost node wrote in its last poll is lost with it
CANCEL_WAIT_S = 10.0  # how long a Ctrl-C waits for cancelled tasks to kill their process
CONNECT_TIMEOUT_S = 5.0
NOT_INSTALLED = "--executor ray needs the ray extra: pip install -e '.[ray]' in a capsafe checkout"
_NOT_FORWARDED = (VISIBLE,)  # the node's own value wins (Ray sets it for a GPU task)


class RayExecutor:
    """Runs each launch as a streaming Ray task (see the module doc)."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self._task = ray.remote(num_returns="streaming", max_retries=0)(run_on_node)
        self._live: set[Any] = set()
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, address: str | None, *, gpus: bool = False) -> RayExecutor:
        """Join the cluster at `address` (None: start or join a local one, as ray.init does);
        SweepError with one line when ray is missing, the cluster cannot be reached, or
        `gpus` are asked of a cluster without any (its tasks would wait forever)."""
        try:
            import ray
        except ImportError:
            raise SweepError(NOT_INSTALLED) from None
        if not ray.is_initialized():
            _check_reachable(address)
            extra: dict[str, Any] = {} if address else {"include_dashboard": False}
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                         **extra)  # fmt: skip
            except Exception as exc:  # ConnectionError, RuntimeError, ValueError: all one line
                where = f"at {address}" if address else "locally"
                raise SweepError(f"--executor ray: cannot start or reach Ray {where}: "
                                 f"{_first_line(exc)}") from None  # fmt: skip
        cluster_resources: Any = ray.cluster_resources  # untyped in ray
        if gpus and not cluster_resources().get("GPU"):
            raise SweepError("--gpus with --executor ray: the Ray cluster has no GPU resource")
        return cls(ray)

    def execute(
        self, launch: Launch, on_tests: Callable[[int], None], stopping: threading.Event
    ) -> Exit:
        inputs = _inputs(launch)
        env = {k: v for k, v in inherited_environ().items() if k not in _NOT_FORWARDED
               and not k.startswith("RAY_")} | dict(launch.env)  # fmt: skip
        counted = [0, 0]  # tests counted so far, by the attempts before and by this one
        notes: list[str] = []

        def progress(n: int) -> None:  # a rerun's tests count once they pass the lost run's
            counted[1] += n
            if counted[1] > counted[0]:
                on_tests(counted[1] - counted[0])
                counted[0] = counted[1]

        for attempt in range(1, RETRIES + 2):
            _start_files(launch, notes)
            counted[1] = 0
            node = ["unknown"]
            try:
                return self._attempt(launch, inputs, env, progress, stopping, node)
            except self._ray.exceptions.TaskCancelledError:
                return Exit(-2, interrupted=True)
            except self._ray.exceptions.RayTaskError:
                raise  # an error in the task's own code: a bug to see, not a lost node
            except self._ray.exceptions.RayError as exc:
                why = type(exc).__name__
                notes.append(f"capsafe: {launch.label} attempt {attempt} on Ray node {node[0]} "
                             f"was lost: {why}: {_first_line(exc)}")  # fmt: skip
        lost = (f"lost with Ray node {node[0]} ({why}), run {RETRIES + 1} times: "
                "recorded as a crash of the test it was in")  # fmt: skip
        with open(launch.log, "ab") as log:
            log.write(("\n".join([*notes[-1:], f"capsafe: {launch.label} {lost}"]) + "\n").encode())
        return Exit(-9, lost=lost)

    def _attempt(
        self,
        launch: Launch,
        inputs: dict[str, bytes],
        env: dict[str, str],
        progress: Callable[[int], None],
        stopping: threading.Event,
        node: list[str],
    ) -> Exit:
        ray = self._ray
        gen = self._task.options(num_gpus=1 if launch.gpus else 0).remote(launch, inputs, env)
        with self._lock:
            self._live.add(gen)
        end: Exit | None = None
        try:
            while True:
                if stopping.is_set():
                    self._cancel(gen)
                    return Exit(-2, interrupted=True)
                ready, _ = ray.wait([gen], timeout=0.2)
                if not ready:
                    continue
                try:
                    item = ray.get(next(gen))
                except StopIteration:
                    break
                if isinstance(item, str):  # first: the node (the log's first line names it)
                    node[0] = item
                    _write(launch, Chunk(log=f"capsafe: {launch.label} runs on Ray node "
                                             f"{item}\n".encode()))  # fmt: skip
                elif isinstance(item, Chunk):
                    _write(launch, item)
                    progress(teardowns(item))
                elif isinstance(item, Exit):
                    end = item
        except ray.exceptions.RayError:
            raise  # the task is gone: nothing to cancel
        except KeyboardInterrupt:  # Ctrl-C in this thread, as the local executor takes it
            self._cancel(gen)
            return Exit(-2, interrupted=True)
        except BaseException:  # never leave a task (and its test process) behind
            self._cancel(gen)
            raise
        finally:
            with self._lock:
                self._live.discard(gen)
        if end is None:
            raise ray.exceptions.RayError(f"the task on node {node[0]} ended without an exit")
        return end

    def _cancel(self, gen: Any) -> None:
        """Cancel a task and give it a moment to kill its process (it does on cancel)."""
        ray = self._ray
        ray.cancel(gen)
        deadline = time.monotonic() + CANCEL_WAIT_S
        try:
            while time.monotonic() < deadline:
                ready, _ = ray.wait([gen], timeout=0.2)
                if ready:
                    ray.get(next(gen))
        except (StopIteration, ray.exceptions.RayError):
            pass

    def kill_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for gen in live:
            self._ray.cancel(gen)


def run_on_node(
    launch: Launch, inputs: Mapping[str, bytes], env: Mapping[str, str]
) -> Iterator[object]:
    """The Ray task: the node id, then the process's `Chunk`s as it runs, then its `Exit`."""
    import ray

    yield ray.get_runtime_context().get_node_id()
    scratch = Path(tempfile.mkdtemp(prefix=f"capsafe-ray-{launch.label}-"))
    try:
        cmd, node_env = _for_node(launch, inputs, env, scratch, ray.get_gpu_ids())
        proc = WatchedProcess(cmd, launch.cwd, node_env, scratch / "records", scratch / "log",
                              launch.stall_limit, tail_log=True,
                              min_interval=STREAM_EVERY_S)  # fmt: skip
        try:
            try:
                proc.start()
            except OSError as exc:  # no checkout or no Python at this path on this node
                yield Chunk(log=f"capsafe: cannot start pytest in {launch.cwd} on this Ray node: "
                            f"{exc.strerror or exc}\n".encode())  # fmt: skip
                yield Exit(3)  # pytest's internal error: the sweep says the suite cannot run
                return
            yield from proc.chunks(threading.Event())  # a cancel lands here as KeyboardInterrupt
            yield proc.exit
        finally:
            proc.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _inputs(launch: Launch) -> dict[str, bytes]:
    """Files under `raw/` the command reads (the replay file), by the path it names them."""
    raw = launch.records.parent
    found: dict[str, bytes] = {}
    for arg in launch.cmd:
        if arg.startswith("--capsafe-") and "=" in arg:
            path = Path(arg.split("=", 1)[1])
            if raw in path.parents and path.is_file():
                found[str(path)] = path.read_bytes()
    return found


def _for_node(
    launch: Launch,
    inputs: Mapping[str, bytes],
    env: Mapping[str, str],
    scratch: Path,
    gpu_ids: list[Any],
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command and environment on this node: records and inputs in `scratch`, the
    shared directory created (per node when --out is not shared), Ray's GPU pinned."""
    paths = {str(launch.records): str(scratch / "records")}
    for k, (name, data) in enumerate(inputs.items()):
        local = scratch / "inputs" / f"{k}-{Path(name).name}"
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
        paths[name] = str(local)
    ids = [str(i) for i in gpu_ids]
    cmd = []
    for arg in launch.cmd:
        option, sep, value = arg.partition("=")
        if sep and option == "--capsafe-gpus" and ids:
            value = as_spec(ids)
        cmd.append(f"{option}={paths.get(value, value)}" if sep else arg)
    node_env = {**os.environ, **env}
    if ids:
        node_env[VISIBLE] = ",".join(ids)
    shared = Path(node_env[SWEEP_SHARED_ENV])
    try:
        shared.mkdir(parents=True, exist_ok=True)
    except OSError:
        shared = Path(tempfile.gettempdir()) / f"capsafe-shared-{shared.parent.parent.name}"
        shared.mkdir(exist_ok=True)
        node_env[SWEEP_SHARED_ENV] = str(shared)
    return tuple(cmd), node_env


def _start_files(launch: Launch, notes: list[str]) -> None:
    """An empty records directory and a log holding only what earlier attempts met."""
    shutil.rmtree(launch.records, ignore_errors=True)
    launch.records.mkdir(parents=True, exist_ok=True)
    launch.log.write_text("".join(f"{note}; run again\n" for note in notes), encoding="utf-8")


def _write(launch: Launch, chunk: Chunk) -> None:
    for name, data in chunk.records.items():
        with open(launch.records / name, "ab") as f:
            f.write(data)
    for name, data in chunk.whole.items():
        (launch.records / name).write_bytes(data)
    if chunk.log:
        with open(launch.log, "ab") as f:
            f.write(chunk.log)


def _check_reachable(address: str | None) -> None:
    """A host:port (or ray://host:port) that takes no TCP connection fails here, in
    seconds, instead of in ray.init's long retry loop."""
    if not address or address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise SweepError(f"--address {address}: give auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise SweepError(f"--address {address}: no Ray cluster reachable there "
                         f"({exc.strerror or exc})") from None  # fmt: skip


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__
