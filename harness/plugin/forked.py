"""`--capsafe-forked`: each test of the process runs in a forked child, set up and torn down there.

The sweep's pair runs repeat a parallel-unsafe test in one process beside its candidate
partners, so a collision a few milliseconds wide gets many chances. A test that cannot
run twice in one process cannot be repeated so: python-fs's `test_addpath` first
expects `import test_foo_bar` to fail, and the second time the module is imported
already. Run in a forked child, every repetition starts from the process's state
before any test ran (its modules imported as collection left them), sets the test's
session, module and function up, runs it, tears them all down (as a neighbour of
another module would), and ends. The child reports through the same hooks as any test
(its records rows, its progress character); the parent only counts a failed child
toward `-x`/`--maxfail` and the exit status.

Not for a process with threads of its own (neighbour threads, an initialised GPU driver):
a forked child has none of them, so the option refuses `--capsafe-neighbors`.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import pytest

OPTION = "--capsafe-forked"
PLUGIN_NAME = "capsafe-forked"
CRASHED = 3  # a child's exit status when its test protocol raised (pytest's INTERNAL_ERROR)
TIMEOUT_GRACE_S = 2.0  # how long a child may take to report its own timeout


def add_option(group: pytest.OptionGroup) -> None:
    group.addoption(
        OPTION,
        action="store_true",
        default=False,
        help="run each test in a forked child of the process, set up and torn down there "
        "(a test that cannot run twice in one process can then be repeated)",
    )


def configure(config: pytest.Config) -> None:
    """Validate the option and register the forking protocol when it is given."""
    if not config.option.capsafe_forked:
        return
    if not hasattr(os, "fork"):
        raise pytest.UsageError(f"{OPTION}: needs os.fork (POSIX only)")
    if config.option.capsafe_neighbors:
        raise pytest.UsageError(
            f"{OPTION}: cannot run with --capsafe-neighbors (a forked child has no threads)"
        )
    config.pluginmanager.register(ForkedTests(), PLUGIN_NAME)


class ForkedTests:
    """Runs every test's protocol in a forked child (see the module doc)."""

    def __init__(self) -> None:
        self.in_child = False
        self.frozen = False

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> bool | None:
        if self.in_child:
            return None  # no answer: the default protocol runs, in this child
        session = item.session
        if not self.frozen:  # a child's garbage collections then skip (and do not copy)
            gc.collect()  # everything the parent holds, as in the fork server
            gc.freeze()
            self.frozen = True
        _flush(item.config)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child ends in os._exit, unseen by coverage
            self.in_child = True
            status = CRASHED
            try:
                before = session.testsfailed
                item.ihook.pytest_runtest_protocol(item=item, nextitem=None)
                status = 1 if session.testsfailed > before else 0
            finally:
                _flush(item.config)
                os._exit(status)
        if _child_status(pid) != 0:
            session.testsfailed += 1
            maxfail = item.config.getoption("maxfail")
            if maxfail and session.testsfailed >= maxfail:
                session.shouldfail = f"stopping after {session.testsfailed} failures"
        return True


def _child_status(pid: int) -> int:
    """The child's exit code, once it ended. pytest-timeout's alarm, set around this
    process's protocol before the fork, fails it here first; the child's own, set just
    after, fails the test there and writes its rows: it gets TIMEOUT_GRACE_S for that
    before it is killed. Any other exception (an interrupt) kills the child, and is raised."""
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except pytest.fail.Exception:
        until = time.monotonic() + TIMEOUT_GRACE_S
        while time.monotonic() < until:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise


def _flush(config: pytest.Config) -> None:
    """Nothing buffered is written twice (by both processes) or lost (by os._exit)."""
    config.get_terminal_writer().flush()
    sys.stdout.flush()
    sys.stderr.flush()
