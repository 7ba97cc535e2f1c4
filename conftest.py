"""Project-wide pytest wiring: GPU tests skip, with one line saying why, when no GPU answers."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _no_gpu_reason() -> str | None:
    from capsafe import backend_cuda

    return backend_cuda.unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    reason = _no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
