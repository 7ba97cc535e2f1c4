"""Neighbour threads in a test process: started after collection, stopped at session end.

Registered by the capsafe plugin when `--capsafe-neighbors N` is given
(`--capsafe-neighbor-calls=ctx_sync,mem_alloc` restricts them to those call
kinds). When they cannot start (no driver, no device, a backend that refuses),
the run does not go on silently without them: every test fails in setup with the
reason, and the status file beside the records says so for the sweep.
"""

from __future__ import annotations

import pytest

from . import neighbors as nb
from . import phase_times

OPTION = "--capsafe-neighbor-calls"
PLUGIN_NAME = "capsafe-neighbors"


def add_option(group: pytest.OptionGroup) -> None:
    group.addoption(
        OPTION,
        metavar="KIND[,KIND...]",
        help="neighbour threads make only these call kinds (hazard-action names, e.g. "
        "ctx_sync,mem_alloc; default: every capture-breaking kind they can make)",
    )


def register(
    config: pytest.Config, count: int, records: str | None, run_id: str, worker: str
) -> None:
    """Validate the options and register the neighbours for this process (count > 0)."""
    text = config.option.capsafe_neighbor_calls
    if text is not None and not count:
        raise pytest.UsageError(f"{OPTION} needs --capsafe-neighbors N")
    if not count:
        return
    try:
        calls = nb.parse_calls(text) if text is not None else None
    except ValueError as exc:
        raise pytest.UsageError(f"{OPTION}: {exc}") from None
    config.pluginmanager.register(NeighborRun(config, count, calls, records, run_id, worker),
                                  PLUGIN_NAME)  # fmt: skip


class NeighborRun:
    """The neighbours of one test process (see the module doc)."""

    def __init__(
        self,
        config: pytest.Config,
        count: int,
        calls: tuple[str, ...] | None,
        records: str | None,
        run_id: str,
        worker: str,
    ) -> None:
        self.config = config
        self.neighbors = nb.Neighbors(count, calls)
        self.records = records
        self.run_id, self.worker = run_id, worker
        self.started = False

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.config.option.collectonly:
            return
        marks = self.config.pluginmanager.get_plugin(phase_times.PLUGIN_NAME)
        if marks is not None:
            marks.mark("collected")
        try:
            self.neighbors.start()  # binds the device: CUDA initialization happens here
            self.started = True
        except nb.NeighborsUnavailable as exc:
            self._warn(f"capsafe: neighbour threads could not start ({exc}); every test fails")
        if marks is not None and self.started:
            marks.mark("cuda_ready")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.neighbors.status.unavailable:
            pytest.fail(
                f"capsafe: neighbour threads could not start: {self.neighbors.status.unavailable}",
                pytrace=False,
            )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        status = self.neighbors.stop() if self.started else self.neighbors.status
        for problem in status.problems:
            self._warn(f"capsafe: neighbour thread problem: {problem}")
        if self.records and (self.started or status.unavailable):
            nb.write_status(nb.status_path(self.records, self.run_id, self.worker), status)

    def _warn(self, text: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(text, yellow=True)
        else:
            print(text)
