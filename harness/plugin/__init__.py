"""The capsafe pytest plugin: records, reproducible order, replay, neighbour threads.

It is loaded into every pytest run of an environment where capsafe is
installed, so with none of its options it registers nothing per test: only the
option parser, one header check and one `sys.modules` lookup after collection
(to turn capsafe's frozen-config guard on when the suite already imported
capsafe). Everything per test lives on `CapsafeRun`, registered only when an
option asks for it. It never imports anything heavy (pandas, numpy, CUDA), so
it does not change the suite it observes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

from ..records import (
    Outcome,
    Record,
    RecordWriter,
    Signal,
    bounded_details,
    first_lines,
    records_path,
)
from . import (
    capture_errors,
    env_watch,
    forked,
    gpus,
    neighbor_run,
    order,
    phase_times,
    protect,
    randomly,
    repeats,
)
from .captures import CaptureLog
from .seeding import Reseeder, registered_seeders

DEFAULT_WATCH_ENV = "CAPSAFE_,CUDA_"
PLUGIN_NAME = "capsafe-run"
CONTROLLER = "controller"

# Failure text (or exception class names) that marks a signal; capture errors: capture_errors.
FROZEN_MARKS = ("FrozenConfigError",)
TIMEOUT_MARKS = ("Timeout (>", "from pytest-timeout")
THREAD_UNSAFE = "thread_unsafe"  # pytest-run-parallel's marker: the test reads shared state
PID_ATTR = "capsafe_pid"
"""A worker's reports carry its pid to the controller (xdist serializes report attributes),
which names it in the crash row of a worker that died mid-test."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("capsafe", "capsafe: test records, reproducible order, neighbours")
    group.addoption(
        "--capsafe-records",
        metavar="DIR",
        help="append one JSON line per test per phase to DIR/records-<run>-<worker>-<pid>.jsonl",
    )
    group.addoption(
        "--capsafe-run-id",
        metavar="ID",
        help="run id stored in every record (default: random hex, shared by xdist workers)",
    )
    group.addoption(
        "--capsafe-seed",
        metavar="N|random",
        help="order seed; also reseeds `random`, numpy (when imported) and pytest-randomly's "
        "registered seeders per test from (seed, node id), and with -n fixes which worker "
        "runs which test",
    )
    group.addoption(
        "--capsafe-shuffle",
        choices=order.SHUFFLE_MODES,
        help="global: shuffle all tests; module: shuffle modules, then tests within each; "
        "none: keep collection order (default: global with a seed, none without)",
    )
    group.addoption(
        "--capsafe-replay",
        metavar="FILE",
        help="run exactly the node ids listed in FILE (one per line) in that order, "
        "in one process (use -n 0 / -p no:xdist)",
    )
    group.addoption(
        "--capsafe-neighbors",
        metavar="N",
        type=int,
        default=0,
        help="run N background threads issuing capture-breaking driver calls while tests run",
    )
    group.addoption(
        "--capsafe-watch-env",
        metavar="PREFIX[,PREFIX...]",
        default=DEFAULT_WATCH_ENV,
        help=f"environment prefixes whose changes a test leaves behind are recorded "
        f"(default {DEFAULT_WATCH_ENV}; * for every variable)",
    )
    protect.add_option(group)
    forked.add_option(group)
    gpus.add_option(group)
    neighbor_run.add_option(group)


@dataclass(frozen=True)
class Settings:
    """The options of one run, resolved once (seed and run id agreed with the xdist controller)."""

    records: str | None
    run_id: str
    seed: int | None
    shuffle: str
    replay: tuple[str, ...] | None
    replay_file: str | None
    neighbors: int
    watch_env: tuple[str, ...]
    randomly: str = ""  # what capsafe set of pytest-randomly's options (harness.plugin.randomly)

    def header(self) -> str:
        seed = "none" if self.seed is None else str(self.seed)
        line = f"capsafe: seed={seed} shuffle={self.shuffle}"
        if self.replay_file:
            line += f" replay={self.replay_file} ({len(self.replay or ())} tests)"
        if self.records:
            line += f" records={self.records} run_id={self.run_id}"
        if self.neighbors:
            line += f" neighbors={self.neighbors}"
        if self.randomly:
            line += f"; {self.randomly}"
        return line


def _active(config: pytest.Config) -> bool:
    opt = config.option
    return bool(
        opt.capsafe_records
        or opt.capsafe_seed is not None
        or opt.capsafe_shuffle not in (None, "none")
        or opt.capsafe_replay
        or opt.capsafe_neighbors
    )


def _resolve(config: pytest.Config) -> Settings:
    opt = config.option
    agreed = getattr(config, "workerinput", {})
    if "capsafe_seed" in agreed:
        seed, run_id = agreed["capsafe_seed"], agreed["capsafe_run_id"]
    else:
        run_id = opt.capsafe_run_id or os.urandom(6).hex()
        seed = None
        if opt.capsafe_seed is not None:
            try:
                seed = order.parse_seed(opt.capsafe_seed)
            except ValueError:
                raise pytest.UsageError(
                    f"--capsafe-seed={opt.capsafe_seed!r}: give a non-negative integer or 'random'"
                ) from None
        elif opt.capsafe_shuffle not in (None, "none"):
            seed = order.parse_seed("random")
    shuffle = opt.capsafe_shuffle or ("global" if seed is not None else "none")
    replay = None
    if opt.capsafe_replay:
        if getattr(opt, "numprocesses", None) and not agreed:
            raise pytest.UsageError(
                "--capsafe-replay runs the listed tests in order in one process; "
                "add -n 0 (or -p no:xdist)"
            )
        try:
            replay = tuple(order.read_replay(opt.capsafe_replay))
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise pytest.UsageError(
                f"--capsafe-replay: cannot read {opt.capsafe_replay}: {reason}"
            ) from None
        shuffle = "none"
    if opt.capsafe_neighbors < 0:
        raise pytest.UsageError("--capsafe-neighbors: give a thread count >= 0")
    if opt.capsafe_records:
        try:
            os.makedirs(opt.capsafe_records, exist_ok=True)
        except OSError as exc:
            raise pytest.UsageError(
                f"--capsafe-records: cannot create {opt.capsafe_records}: {exc.strerror or exc}"
            ) from None
    prefixes = (p.strip() for p in opt.capsafe_watch_env.split(","))
    watch = tuple("" if p == "*" else p for p in prefixes if p)  # "*": every variable
    return Settings(
        records=opt.capsafe_records,
        run_id=run_id,
        seed=seed,
        shuffle=shuffle,
        replay=replay,
        replay_file=opt.capsafe_replay,
        neighbors=opt.capsafe_neighbors,
        watch_env=watch,
        randomly=randomly.take_over(config, seed),
    )


def _enable_frozen_guard(import_capsafe: bool) -> None:
    """Turn capsafe's frozen-config guard on, importing capsafe only when asked to."""
    if not import_capsafe and "capsafe.config" not in sys.modules:
        return
    try:
        from capsafe.config import enable_guard
    except ImportError:
        return
    enable_guard()


GPUS_KEY = pytest.StashKey[tuple[str, ...]]()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """--capsafe-gpus: pin this process to its device before a conftest can initialise CUDA."""
    known = early_config.known_args_namespace
    spec = getattr(known, "capsafe_gpus", None)
    if not spec:
        return
    workers = getattr(known, "numprocesses", None)
    try:
        early_config.stash[GPUS_KEY] = gpus.pin_this_process(
            spec, spawns_workers=bool(workers) and getattr(known, "dist", "load") != "no"
        )
    except gpus.GpuError as exc:
        raise pytest.UsageError(f"--capsafe-gpus {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    protect.configure(config)
    forked.configure(config)
    if not _active(config):
        return
    settings = _resolve(config)
    config.pluginmanager.register(CapsafeRun(config, settings), PLUGIN_NAME)
    _enable_frozen_guard(import_capsafe=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Without options: the suite's own modules are imported now; if they use
    # capsafe, guard its configuration before the first test runs.
    _enable_frozen_guard(import_capsafe=False)


def pytest_report_header(config: pytest.Config) -> str | None:
    run = config.pluginmanager.get_plugin(PLUGIN_NAME)
    return run.settings.header() if run is not None else None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: hand every worker the same seed and run id."""
    run = node.config.pluginmanager.get_plugin(PLUGIN_NAME)
    if run is not None:
        node.workerinput["capsafe_seed"] = run.settings.seed
        node.workerinput["capsafe_run_id"] = run.settings.run_id


def _reason(marker: pytest.Mark) -> str:
    """A thread_unsafe marker's reason, as pytest-run-parallel takes it (keyword or first
    argument)."""
    reason = marker.kwargs.get("reason", marker.args[0] if marker.args else "")
    return str(reason) or "marked thread_unsafe (no reason given)"


def _signals(text: str, exc_names: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    if capture_errors.in_text(text) or "CaptureInvalidated" in exc_names:
        found.append(Signal.CAPTURE_INVALIDATED)
    if any(m in text for m in FROZEN_MARKS) or "FrozenConfigError" in exc_names:
        found.append(Signal.FROZEN_CONFIG)
    if any(m in text for m in TIMEOUT_MARKS):
        found.append(Signal.TIMEOUT)
    return found


def _outcome(report: pytest.TestReport) -> Outcome:
    """pytest's outcome, with xfail's two results told apart from skipped and passed."""
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "xfailed"
        if report.passed:
            return "xpassed"
    return report.outcome


def _message(report: pytest.TestReport) -> tuple[str, str]:
    """(first lines, full text bounded) of a non-pass report: the failure, skip or xfail reason."""
    longrepr = report.longrepr
    reason = str(getattr(report, "wasxfail", "") or "")
    if longrepr is None:  # an xpass: only the reason it was expected to fail
        text = f"expected to fail ({reason})" if reason else "expected to fail"
        return first_lines(text), text
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        text = str(longrepr[2])
        return first_lines(text), bounded_details(text)
    crash = getattr(longrepr, "reprcrash", None)
    head = crash.message if crash is not None else str(longrepr)
    if reason and report.skipped:  # an xfail: its reason, then how it failed
        head = f"expected to fail ({reason}): {head}"
    return first_lines(head), bounded_details(report.longreprtext)


def _crash_line(text: str) -> str:
    """The last line of xdist's crash report (which worker crashed in which test), without
    any header above it."""
    lines = [line for line in text.splitlines() if line.strip()]
    return first_lines(lines[-1] if lines else text)


class CapsafeRun:
    """Per-run state and per-test hooks, registered only when a capsafe option is given."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        workerinput = getattr(config, "workerinput", None)
        self.worker = workerinput["workerid"] if workerinput else "main"
        self.writer: RecordWriter | None = None
        self.index = -1
        self.test_seed = 0
        self.reseed: Reseeder | None = None
        self.pid = os.getpid()
        self.gpus = config.stash.get(GPUS_KEY, ())
        self.env_before: dict[Any, Any] = {}
        self.exc_names: dict[tuple[str, str], tuple[str, ...]] = {}
        self.captures = CaptureLog()  # where the current test's captures are (records only)
        self.in_capture: set[tuple[str, str]] = set()  # phases that failed inside a window
        self.thread_unsafe: dict[str, str] = {}  # node id -> its thread_unsafe marker's reason
        # The node ids as collection handed them to this plugin, before it reordered them: a
        # fork server plans the sweep's suite runs from it (what each xdist worker shuffles).
        self.received: tuple[str, ...] = ()
        # xdist controller only: per worker, tests started, the last one set up, its pid (from
        # its reports), and the tests xdist said it crashed in (pytest_handlecrashitem).
        self.started: dict[str, int] = {}
        self.last_setup: dict[str, str] = {}
        self.worker_pid: dict[str, int] = {}
        self.crashed: set[tuple[str, str]] = set()
        phase_times.register(config, settings.records, settings.run_id, self.worker)
        neighbor_run.register(
            config, settings.neighbors, settings.records, settings.run_id, self.worker
        )

    # -- session --------------------------------------------------------------
    def _is_controller(self) -> bool:
        return self.config.pluginmanager.has_plugin("dsession")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.settings.records and not self._is_controller():
            path = records_path(
                self.settings.records, self.settings.run_id, self.worker, os.getpid()
            )
            try:
                self.writer = RecordWriter(path)
            except OSError as exc:
                raise pytest.UsageError(
                    f"--capsafe-records: cannot write {path}: {exc.strerror or exc}"
                ) from None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.captures.stop()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _warn(self, text: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(text, yellow=True)
        else:
            print(text, file=sys.stderr)

    # -- order ----------------------------------------------------------------
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        settings = self.settings
        self.received = tuple(item.nodeid for item in items)
        if settings.replay is not None:
            chosen, missing = order.replay_order(items, settings.replay, lambda i: i.nodeid)
            if missing:
                shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise pytest.UsageError(
                    f"--capsafe-replay: {len(missing)} listed test(s) were not collected: {shown}"
                    + _spaced_replay_hint(config)
                )
            keep = {id(item) for item in chosen}
            dropped = [item for item in items if id(item) not in keep]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = chosen
        elif settings.seed is not None and settings.shuffle != "none":
            items[:] = order.shuffled(items, settings.seed, settings.shuffle, lambda i: i.nodeid)

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        """With a seed, xdist's default `load` split becomes a function of the seed."""
        if self.settings.seed is None or config.getvalue("dist") != "load":
            return None
        from .schedule import SeededScheduling

        return SeededScheduling(config, log)

    # The generators restart from the same (seed, node id) state before each phase, as
    # in pytest-randomly, so a seeded failure repeats whatever ran before it.
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.settings.seed is not None:
            self.test_seed = order.per_test_seed(self.settings.seed, item.nodeid)
            self._reseed()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        if self.settings.seed is not None:
            self._reseed()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        if self.settings.seed is not None:
            self._reseed()
        if self.settings.replay is not None:
            repeats.tear_down_repetition(item, nextitem)

    def _reseed(self) -> None:
        if self.reseed is None:
            seeders, problems = registered_seeders()
            for problem in problems:
                self._warn(f"capsafe: not reseeding with {problem}")
            self.reseed = Reseeder(seeders)
        self.reseed(self.test_seed)

    # -- records --------------------------------------------------------------
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if self.writer is not None:
            self.index += 1
            self.env_before = env_watch.snapshot()
            self.captures.start()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if self.writer is not None and call.when == "setup":
            marker = item.get_closest_marker(THREAD_UNSAFE)
            if marker is not None:
                self.thread_unsafe[item.nodeid] = _reason(marker)
        if self.writer is not None and self.worker != "main":
            setattr(report, PID_ATTR, self.pid)
        if self.writer is not None and call.excinfo is not None:
            names = tuple(cls.__name__ for cls in type(call.excinfo.value).__mro__)
            if capture_errors.capture_error(call.excinfo.value):  # any framework's counts
                names += ("CaptureInvalidated",)
            self.exc_names[(report.nodeid, report.when)] = names
            if self.captures.failure_inside():
                self.in_capture.add((report.nodeid, report.when))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)
        if node is not None:  # a worker's report arriving at the xdist controller
            if self.settings.records:
                self._controller_saw(report, node.gateway.id, self.settings.records)
            return
        if self.writer is None:
            return
        exc_names = self.exc_names.pop((report.nodeid, report.when), ())
        inside = (report.nodeid, report.when) in self.in_capture
        self.in_capture.discard((report.nodeid, report.when))
        signals: list[str] = []
        outcome = _outcome(report)
        message = details = ""
        if outcome != "passed":
            message, details = _message(report)
            if report.failed:
                signals = _signals(report.longreprtext, exc_names)
                if inside:
                    signals.append(Signal.FAILED_IN_CAPTURE)
        now = time.time()
        row: Record = {
            "nodeid": report.nodeid,
            "phase": report.when,
            "outcome": outcome,
            "duration": report.duration,
            "run_id": self.settings.run_id,
            "seed": self.settings.seed,
            "worker": self.worker,
            "index": self.index,
            "pid": self.pid,
            "signals": signals,
            "message": message,
            "details": details,
            "start": getattr(report, "start", now - report.duration),
            "stop": getattr(report, "stop", now),
            "time": now,
            "gpu": gpus.for_worker(self.gpus, self.worker) if self.gpus else "",
        }
        if report.when == "teardown":
            captures = self.captures.recorded()
            if captures:
                row["captures"] = captures
            marked = self.thread_unsafe.pop(report.nodeid, None)
            if marked is not None:
                row["thread_unsafe"] = marked
            after = env_watch.snapshot()
            leak = after != self.env_before and env_watch.leaks(
                self.env_before, after, self.settings.watch_env
            )
            if leak:
                row["env_leak"] = leak
                row["signals"] = [*signals, Signal.ENV_LEAK]
        self.writer.write(row)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodeready(self, node: Any) -> None:
        """xdist controller: a new worker process (a replacement keeps the dead one's id)."""
        self.worker_pid.pop(node.gateway.id, None)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        """xdist controller: a worker died while running `crashitem`; its report follows
        through pytest_runtest_logreport, where the crash row is written (unless another
        plugin turned the report into a rerun)."""
        node = getattr(report, "node", None)
        if node is not None:
            self.crashed.add((node.gateway.id, crashitem))

    def _controller_saw(self, report: pytest.TestReport, worker: str, records: str) -> None:
        pid = getattr(report, PID_ATTR, None)
        if isinstance(pid, int):
            self.worker_pid[worker] = pid
        if report.when == "setup":
            self.started[worker] = self.started.get(worker, 0) + 1
            self.last_setup[worker] = report.nodeid
            return
        crashed = (worker, report.nodeid) in self.crashed
        self.crashed.discard((worker, report.nodeid))
        if not (crashed and report.failed):
            return
        started = self.started.get(worker, 0)
        index = started - 1 if self.last_setup.get(worker) == report.nodeid else started
        now = time.time()
        row: Record = {
            "nodeid": report.nodeid,
            "phase": "call",
            "outcome": "failed",
            "duration": report.duration,
            "run_id": self.settings.run_id,
            "seed": self.settings.seed,
            "worker": worker,
            "index": index,
            "pid": self.worker_pid.get(worker, 0),  # 0: it died before its first report
            "signals": [Signal.CRASH],
            "message": _crash_line(report.longreprtext),
            "details": bounded_details(report.longreprtext),
            "start": getattr(report, "start", now - report.duration),
            "stop": getattr(report, "stop", now),
            "time": now,
            "gpu": gpus.for_worker(self.gpus, worker) if self.gpus else "",
        }
        if self.writer is None:
            self.writer = RecordWriter(
                records_path(records, self.settings.run_id, CONTROLLER, os.getpid())
            )
        self.writer.write(row)


def _spaced_replay_hint(config: pytest.Config) -> str:
    """Why listed ids went missing when the file was given as `--capsafe-replay FILE`.

    pytest picks its rootdir and ini before it loads plugins, so at that point it does not
    know the option and takes FILE for a test path: a FILE outside the project moves the
    rootdir (every node id gains a prefix, the project's ini is not read). `=` keeps the
    option and its value one word. A limit of pytest's, so the message names the fix.
    """
    args = [str(arg) for arg in config.invocation_params.args]
    if "--capsafe-replay" not in args:
        return ""
    return (
        f"; pytest chose rootdir {config.rootpath} taking the file after a space for a test "
        f"path (it reads its ini before capsafe's options): write "
        f"--capsafe-replay={config.option.capsafe_replay}"
    )
