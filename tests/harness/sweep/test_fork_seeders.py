"""A forked replay's first test finds the seeders read: the fork server reads the
`pytest_randomly.random_seeder` entry points before forking, so no child scans every
installed distribution in its first test's setup (15-50 ms each on the shared machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsafe_harness.plugin import order
from capsafe_harness.sweep.executor import LocalExecutor
from capsafe_harness.sweep.fork_executor import ForkExecutor
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.runner import ProcessResult, Runner

# In the process under test: its seeders were read before this test's setup asked for them
# (a hit of the cache), or by that setup itself (the one miss, no hit yet).
SUITE = """
from capsafe_harness.plugin import seeding


def test_seeders_were_read_before_me():
    assert seeding.registered_seeders.cache_info().hits >= 1
"""


def run_alone(suite: Path, raw: Path, executor: LocalExecutor) -> ProcessResult:
    options = SweepOptions(paths=(suite,), out=raw.parent, seed=1, invoked_from=suite,
                           pytest_args=("-p", "no:run-parallel"), progress=False)  # fmt: skip
    runner = Runner(options, raw, executor=executor)
    runner.rootdir, runner.inifile = suite, str(suite / "pytest.ini")
    sequence = ["test_s.py::test_seeders_were_read_before_me"]
    replay_file = raw / "replays" / "alone-1.txt"
    order.write_replay(replay_file, sequence)
    cmd = runner.pytest_command(runner.replay_targets(sequence), raw / "alone-1", "alone-1",
                                seed=3, workers=0, replay_file=replay_file)  # fmt: skip
    return runner.run("alone-1", cmd)


@pytest.mark.timeout(300)
def test_a_forked_child_inherits_the_seeders_the_server_read(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_s.py").write_text(SUITE)
    fresh = run_alone(suite, tmp_path / "fresh" / "raw", LocalExecutor())
    forks = ForkExecutor([os.curdir], tmp_path / "servers", start_timeout=120)
    try:
        forked = run_alone(suite, tmp_path / "forked" / "raw", forks)
        assert (forks.forked, forks.fresh) == (1, 0), forks.refusals
    finally:
        forks.close()
    call = [r["outcome"] for r in forked.rows if r["phase"] == "call"]
    assert call == ["passed"], [r["message"] for r in forked.rows]
    # the reference: a fresh process reads them in its first test's setup
    assert [r["outcome"] for r in fresh.rows if r["phase"] == "call"] == ["failed"]
