"""The fixing phase of `capsafe sweep --fix` (issue 25) around a stand-in engine: replays in
a scratch copy of the suite run its patched files (never the fork server's imported ones),
the verified patch lands in --out/fixes and the report, `capsafe fix` applies it, and a
resumed sweep takes each finished search from the journal instead of running it again."""

from __future__ import annotations

import difflib
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tqdm import tqdm  # type: ignore[import-untyped]

from capsafe.cli import main
from capsafe_harness.fix.case import FixCase, VerifiedPatch
from capsafe_harness.sweep.console import console_lines
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.run import Sweep
from capsafe_harness.sweep.state import prepare_out

PLANTED = Path(__file__).resolve().parents[3] / "repro" / "suites" / "fix_registry"
QUIET = ("-p", "no:run-parallel", "-p", "no:hypothesispytest")
POLLUTER = "test_register.py"
FIXED = 'registry.register("fast-path")\n    registry.PLUGINS.remove("fast-path")'
ReplayIn = Callable[[Path, Sequence[str]], Mapping[str, bool | None]]


@pytest.fixture(autouse=True)
def no_monitor_thread_left() -> Iterator[None]:
    """The sweep's progress bar starts tqdm's monitor thread even disabled; stopped after each
    test here, as test_fork_server's thread check (a polluter victim of any in-process sweep,
    under xdist) expects none."""
    yield
    if tqdm.monitor is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None


class Engine:
    """find_patch's stand-in: replays the cause and victim here and in a patched copy."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.seen: dict[str, Mapping[str, bool | None]] = {}

    def __call__(self, case: FixCase, rootdir: Path, replay: ReplayIn, *, times: int,
                 budget_left: Callable[[], bool]) -> VerifiedPatch | None:  # fmt: skip
        sequence = [*case.causes, case.victim]
        self.seen["here"] = replay(rootdir, sequence)
        shutil.copytree(rootdir, self.scratch)
        before = (rootdir / POLLUTER).read_text()
        after = before.replace('registry.register("fast-path")', FIXED)
        (self.scratch / POLLUTER).write_text(after)
        self.seen["patched"] = replay(self.scratch, sequence)
        if self.seen["patched"][case.victim] is not False:
            return None
        diff = "".join(difflib.unified_diff(before.splitlines(keepends=True),
                                            after.splitlines(keepends=True),
                                            f"a/{POLLUTER}", f"b/{POLLUTER}"))  # fmt: skip
        return VerifiedPatch(case.victim, POLLUTER, hashlib.sha256(before.encode()).hexdigest(),
                             diff, "idiom", "the polluter removes what it registered",
                             {"replays": 2})  # fmt: skip


def swept(suite: Path, out: Path, engine: Callable[..., VerifiedPatch | None], *,
          resume: bool = False) -> dict[str, Any]:  # fmt: skip
    key = json.loads((suite / "answer_key.json").read_text())
    options = SweepOptions(paths=(suite,), out=out, invoked_from=suite.parent, pytest_args=QUIET,
                           progress=False, fix=True, resume=resume, timeout=10,
                           **key["sweep"])  # fmt: skip
    prepare_out(out, resume=resume, force=False)
    sweep = Sweep(options)
    sweep.fixes.find_patch = engine
    result = sweep.execute()
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["console"] = console_lines(result)
    return summary


@pytest.mark.timeout(300)
def test_a_patch_replayed_in_a_scratch_copy_is_written_reported_and_applied(
    tmp_path: Path,
) -> None:
    suite, out = tmp_path / "suite", tmp_path / "out"
    shutil.copytree(PLANTED, suite)
    engine = Engine(tmp_path / "scratch")
    summary = swept(suite, out, engine)
    victim = "test_lookup.py::test_registry_starts_empty"
    assert engine.seen["here"][victim] is True  # the polluter still pollutes in the suite
    assert engine.seen["patched"][victim] is False  # the copy's patched polluter ran
    assert list((out / "raw" / "fixes").glob("fix-*.log"))  # apart from the sweep's records
    verdict = next(t for t in summary["tests"] if t["nodeid"] == victim)
    assert verdict["classification"] == "order-dependent"
    assert verdict["fix"]["how"] == "the polluter removes what it registered"
    assert verdict["fix"]["apply"] == f"capsafe fix out {victim}"
    assert summary["fixes"] == [{"victim": victim, "kind": "order-dependent", "cleaners": [],
                                 "cleaner_replays": 1, "patched": True,
                                 "outcome": verdict["fix"]["how"]}]  # fmt: skip
    assert "fixes" in summary["phase_times"]["sweep_s"]
    assert "```diff" in (out / "report.md").read_text()
    assert ("  fixes: 1 of 1 verdicts got a verified patch; apply them all with "
            "`capsafe fix out`") in summary["console"]  # fmt: skip
    assert (out / "fixes" / Path(verdict["fix"]["patch"]).name).is_file()

    assert main(["fix", str(out)]) == 0
    assert FIXED in (suite / POLLUTER).read_text()


@pytest.mark.timeout(300)
def test_a_resumed_sweep_takes_the_finished_fix_from_the_journal(tmp_path: Path) -> None:
    suite, out = tmp_path / "suite", tmp_path / "out"
    shutil.copytree(PLANTED, suite)
    first = swept(suite, out, Engine(tmp_path / "scratch"))
    shutil.rmtree(out / "fixes")

    def never(*args: Any, **kwargs: Any) -> VerifiedPatch | None:
        raise AssertionError("a finished patch search ran again")

    again = swept(suite, out, never, resume=True)
    assert [replace_notes(t) for t in again["tests"]] == [replace_notes(t) for t in first["tests"]]
    assert again["fixes"] == first["fixes"]
    assert len(list((out / "fixes").glob("*.json"))) == 1


def replace_notes(test: dict[str, Any]) -> dict[str, Any]:
    """A verdict without what differs between two sweeps of one suite (timings, replays)."""
    return {k: test[k] for k in ("nodeid", "classification", "polluters", "cleaners", "fix")}


def test_the_sweep_without_fix_has_no_fixing_phase(tmp_path: Path) -> None:
    options = SweepOptions(paths=(PLANTED,), out=tmp_path, seed=1)
    assert "fixes" not in [name for name, _ in Sweep(options).phases()]
    assert "fixes" in [name for name, _ in Sweep(replace(options, fix=True)).phases()]


def test_a_sweep_without_fix_never_imports_the_fix_engine() -> None:
    """libcst (the engine's) took 2-3 s of every sweep's start-up on the shared machine;
    only --fix asks for it."""
    probe = "import sys, capsafe.cli; capsafe.cli.build_parser(); print(sorted(sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    loaded = done.stdout
    assert "capsafe_harness.sweep.run" in loaded  # the sweep's whole CLI was loaded
    assert "libcst" not in loaded and "capsafe_harness.fix.case" not in loaded
