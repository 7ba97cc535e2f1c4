"""The capture observer: told of every begin and end, changing nothing the caller sees."""

from __future__ import annotations

import os
import sys
from collections.abc import Hashable, Iterator
from typing import Any

import fake_torch as fake_torch_module
import pytest
from fake_torch import fake_torch

from capsafe.driver import GatedDriver
from capsafe.errors import CudaError
from capsafe.handles import CaptureMode
from capsafe.integrations.observe import POINTS, Observer, Opened
from capsafe.sim import SimBackend


class Told:
    def __init__(self) -> None:
        self.begun: list[tuple[str, Opened, str]] = []
        self.ended: list[tuple[str, Hashable, BaseException | None, BaseException | None]] = []

    def begin(self, name: str, opened: Opened, site: str) -> None:
        self.begun.append((name, opened, site))

    def end(
        self, name: str, key: Hashable, raised: BaseException | None, flight: BaseException | None
    ) -> None:
        self.ended.append((name, key, raised, flight))


@pytest.fixture
def told() -> Iterator[tuple[Told, Observer]]:
    told = Told()
    observer = Observer(told.begin, told.end)
    yield told, observer
    observer.restore()


def _line_of(marker: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker))


def test_facade_captures_are_seen_with_the_callers_line_and_restored(
    sim_backend: SimBackend, told: tuple[Told, Observer]
) -> None:
    seen, observer = told
    original = GatedDriver.__dict__["stream_begin_capture"]
    assert "facade" in observer.hook_loaded()
    assert GatedDriver.__dict__["stream_begin_capture"] is not original
    drv: Any = GatedDriver(sim_backend, None)
    stream = drv.stream_create(nonblocking=True)
    drv.stream_begin_capture(stream, CaptureMode.THREAD_LOCAL)  # begin-here
    graph = drv.stream_end_capture(stream)
    drv.graph_destroy(graph)
    # Told by the backend behind the facade, then by the facade: one key, one site.
    (inner, opened, site), (outer, again, site_again) = seen.begun
    assert (inner, outer) == ("backend-sim", "facade") and (opened, site) == (again, site_again)
    assert (opened.mode, opened.stream) == ("thread_local", hex(stream.value))
    assert site.endswith(f"test_observe.py:{_line_of('# begin-here')}")
    assert [e[1:] for e in seen.ended] == [(opened.key, None, None)] * 2
    # An end the driver refuses raises exactly what it raised, and the observer is told.
    with pytest.raises(CudaError) as refused:
        drv.stream_end_capture(stream)
    assert seen.ended[-1][2] is refused.value
    observer.restore()
    assert GatedDriver.__dict__["stream_begin_capture"] is original
    drv.stream_destroy(stream)


@pytest.mark.parametrize("split", [False, True], ids=["torch-2.11", "split-end"])
def test_a_with_block_exit_sees_the_exception_in_flight(
    sim_backend: SimBackend, monkeypatch: pytest.MonkeyPatch, split: bool
) -> None:
    seen = Told()
    # The fake stands for torch's own (installed, library) code: skipped like it.
    observer = Observer(seen.begin, seen.end, skip=(os.path.abspath(fake_torch_module.__file__),))
    torch = fake_torch(sim_backend, split=split)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert "torch" in observer.hook_loaded()
    graph = torch.cuda.CUDAGraph()
    try:
        with pytest.raises(ValueError, match="library error"), torch.cuda.graph(graph):  # with-here
            raise ValueError("library error")
    finally:
        observer.restore()
    ((name, opened, site),) = [b for b in seen.begun if b[0] == "torch"]  # the sim's own too
    assert (name, opened.mode) == ("torch", "global")
    # torch.cuda.graph's __enter__ (library code) began it: the site is the test's `with`.
    assert site.endswith(f"test_observe.py:{_line_of('# with-here')}")
    (_, key, raised, flight), *more = [e for e in seen.ended if e[0] == "torch"]  # split: 2
    assert key == opened.key and raised is None and isinstance(flight, ValueError)
    assert all(k == key for _, k, _, _ in more)


def test_nothing_is_imported_or_hooked_for_a_framework_not_loaded(
    told: tuple[Told, Observer], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, observer = told
    for name in ("cupy", "torch", "cuda.core", "cuda.core.graph", "cuda.core.experimental"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    hooked = observer.hook_loaded()
    assert not {"cupy", "torch", "cuda_core"} & set(hooked)
    assert not {"cupy", "torch", "cuda.core"} & set(sys.modules)
    names = {"facade", "backend-sim", "backend-cuda", "cupy", "cuda_core", "torch"}
    assert {p.name for p in POINTS} == names
