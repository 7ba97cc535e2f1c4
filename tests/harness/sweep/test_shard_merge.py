"""`capsafe sweep --shard K/N` and `capsafe merge` (issue 14): three shards merged classify
every test as the unsharded sweep with the same seed does; bad shards are refused."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from capsafe_harness.sweep.shard import Shard, bucket, parse_shard, stable_hash

FAST = ("--", "-p", "no:run-parallel", "-p", "no:hypothesispytest")  # lighter test processes
SEED = 1  # with it the victim fails only in shard 1's run but is shard 2's to rerun alone
SUITE = """
    import pytest

    STATE = []
    CACHE = {}

    @pytest.mark.parametrize("i", range(4))
    def test_polluter(i):
        STATE.append(i)

    def test_victim():
        assert not STATE, "polluted"

    def test_setter():
        CACHE["unit"] = "m"

    def test_brittle():
        assert CACHE["unit"] == "m"

    @pytest.mark.parametrize("i", range(4))
    def test_ok(i):
        assert i >= 0
"""
MADE_HERE = re.compile(r"(?!run-)[a-z]+-\d+\b")  # a merge's rerun or replay (a shard's: alone-s2-1)
VICTIM, BRITTLE = "test_state.py::test_victim", "test_state.py::test_brittle"
SWEEP = ("--no-progress", "--runs", "3", "--workers", "2", "--isolation-runs", "1",
         "--seed", str(SEED), "--timeout", "20")  # fmt: skip


def capsafe(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "capsafe.cli", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 280) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def verdicts(out: Path) -> dict[str, tuple[Any, ...]]:
    tests = json.loads((out / "summary.json").read_text())["tests"]
    return {t["nodeid"]: (t["classification"], t["polluters"], t["state_setters"], t["runs"],
                          t["failures"], t["isolation_runs"], t["isolation_failures"])
            for t in tests}  # fmt: skip


def merge(*args: str, cwd: Path) -> tuple[int, str]:
    return finish(capsafe("merge", "--no-progress", *args, cwd=cwd))


@pytest.mark.slow  # four sweeps and three merges
@pytest.mark.timeout(600)
def test_three_shards_merged_classify_as_the_unsharded_sweep(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_state.py").write_text(textwrap.dedent(SUITE))
    shards = [tmp_path / "shards" / f"shard-{k}" for k in (1, 2, 3)]
    procs = [capsafe("sweep", "suite", *SWEEP, "--shard", f"{k}/3", "--out", str(out), *FAST,
                     cwd=tmp_path) for k, out in enumerate(shards, start=1)]  # fmt: skip
    for proc in procs:
        code, err = finish(proc)
        assert code == 0, err  # a shard's exit says it ran; the merge's is the verdict
    alone = tmp_path / "alone" / "whole"  # the unsharded sweep, while the merge runs
    whole = capsafe("sweep", "suite", *SWEEP, "--out", str(alone), *FAST, cwd=tmp_path)
    merged = tmp_path / "reports" / "merged"
    code, err = merge(str(merged), *map(str, reversed(shards)), cwd=tmp_path)
    assert code == 1, err
    code, err = finish(whole)
    assert code == 1, err

    # A shard is a partial view: its runs only, no searches, nothing claimed.
    first = json.loads((shards[0] / "summary.json").read_text())
    assert first["shard"] == "1/3" and first["runs"] == 1 and first["searches"] == []
    assert "shard 1 of 3: partial view" in (shards[0] / "report.md").read_text()
    assert {t["classification"] for t in first["tests"]} <= {"pass", "unverified"}
    assert not (tmp_path / "shards" / "history.csv").exists()  # only the merge writes one

    # The merge equals the unsharded sweep, test by test.
    got, want = verdicts(merged), verdicts(alone)
    assert got == want
    assert got[VICTIM][0] == "order-dependent" and len(got[VICTIM][1]) == 1
    assert got[VICTIM][1][0].startswith("test_state.py::test_polluter[")
    assert got[BRITTLE][:3] == ("brittle", [], ["test_state.py::test_setter"])
    assert got["test_state.py::test_ok[0]"][0] == "pass"
    # The victim failed only in shard 1's run but is shard 2's to rerun: shard 2 ran it alone
    # once, as every test that passed a shard's runs is (issue 24), and the merge counts that
    # rerun instead of running it again.
    reruns = {n: label for n, _, label in json.loads((merged / "sweep.json").read_text())["alone"]}
    assert bucket(VICTIM, SEED, 3) == bucket(BRITTLE, SEED, 3) == 2
    assert all(reruns[n].startswith("alone-s2-") for n in (VICTIM, BRITTLE)), reruns
    history = (tmp_path / "reports" / "history.csv").read_text().splitlines()
    assert sum(VICTIM in line for line in history) == 1
    assert all(suite.name in line for line in history[1:])  # keyed by the suite's paths

    # --no-run: nothing runs; what needed a rerun or a search is unverified.
    junit = tmp_path / "no-run.xml"
    code, err = merge("--no-run", str(tmp_path / "no-run"), *map(str, shards), "--junitxml",
                      str(junit), cwd=tmp_path)  # fmt: skip
    assert code == 1, err
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert len(cases) == len(verdicts(merged)) and cases["test_victim"].find("failure") is not None
    lazy = verdicts(tmp_path / "no-run")
    assert lazy[VICTIM][0] == lazy[BRITTLE][0] == "unverified"
    assert lazy[VICTIM][5] == lazy[BRITTLE][5] == 1  # shard 2 ran each alone once
    assert lazy["test_state.py::test_ok[0]"][0] == "pass"
    assert not [p for p in (tmp_path / "no-run" / "raw").iterdir() if MADE_HERE.match(p.name)]

    # Refused, one line each, exit 2.
    bad_seed = tmp_path / "bad-seed"
    shutil.copytree(shards[2], bad_seed)
    state = json.loads((bad_seed / "sweep.json").read_text())
    state["options"]["seed"] = SEED + 1
    (bad_seed / "sweep.json").write_text(json.dumps(state))
    for args, says in (
        ((*map(str, shards[:2]), str(bad_seed)), "seed is 2 there but 1"),
        (tuple(map(str, shards[:2])), "shard 3/3 missing"),
        ((*map(str, shards), str(shards[0])), "shard 1/3 given twice"),
        ((*map(str, shards[:2]), str(alone)), "is not a shard"),
    ):
        code, err = merge(str(tmp_path / "refused"), *args, cwd=tmp_path)
        assert (code, err.count("\n")) == (2, 1) and says in err, err
    code, err = merge(str(merged), *map(str, shards), cwd=tmp_path)
    assert code == 2 and "not empty" in err, err


@pytest.mark.parametrize("write, says", [
    (None, "no such directory"),
    ({}, "holds no sweep"),
    ("{not json", "is not a sweep's state"),
    ({"options": {"shard": "4/3"}}, "is not a sweep's state: --shard must be K/N"),
    ({"options": {"shard": "1/2", "runs": 2}, "runs_done": [], "processes": {}, "alone": [],
      "invoked_from": "/"}, "did not finish its runs (0 of 1 done)"),
    ({"options": {"shard": "1/2", "runs": 2}, "runs_done": [1], "alone": [],
      "processes": {"run-1": {"returncode": 1, "stalled": False}}, "invoked_from": "/"},
     "lacks the records of run-1"),
])  # fmt: skip
def test_bad_shard_directories_are_one_line_usage_errors(
    tmp_path: Path, write: str | dict[str, object] | None, says: str
) -> None:
    shard = tmp_path / "shard"
    if write is not None:
        shard.mkdir()
    if isinstance(write, dict) and write:
        (shard / "sweep.json").write_text(json.dumps(write))
    elif isinstance(write, str):
        (shard / "sweep.json").write_text(write)
    code, err = merge(str(tmp_path / "out"), str(shard), cwd=tmp_path)
    assert code == 2 and err.count("\n") == 1 and says in err, err
    assert "Traceback" not in err


def test_shards_deal_out_every_run_and_every_test_once() -> None:
    shards = [Shard(k, 3) for k in (1, 2, 3)]
    assert sorted(k for s in shards for k in s.runs(7)) == list(range(1, 8))
    assert shards[0].runs(7) == [1, 4, 7]
    ids = [f"t.py::test_{i}" for i in range(60)]
    owners = [[s.index for s in shards if s.owns(n, 5)] for n in ids]
    assert all(len(found) == 1 for found in owners)
    assert {found[0] for found in owners} == {1, 2, 3}  # a spread, not one bucket
    assert [bucket(n, 5, 3) for n in ids] == [bucket(n, 5, 3) for n in ids]  # stable
    assert stable_hash(5, "x") != stable_hash(6, "x")  # under the seed
    assert parse_shard("2/3") == Shard(2, 3)
    for bad in ("0/3", "4/3", "3", "a/b", "1/0"):
        with pytest.raises(ValueError, match="--shard must be K/N"):
            parse_shard(bad)


def test_sweep_refuses_a_shard_without_a_seed_or_with_more_shards_than_runs(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("def test_a():\n    pass\n")
    code, err = finish(capsafe("sweep", "--no-progress", ".", "--shard", "1/2", "--out",
                               str(tmp_path / "o"), cwd=tmp_path))  # fmt: skip
    assert code == 2 and "--shard needs --seed" in err, err
    code, err = finish(capsafe("sweep", "--no-progress", ".", "--shard", "3/2", "--seed", "1",
                               "--out", str(tmp_path / "o"), cwd=tmp_path))  # fmt: skip
    assert code == 2 and "--shard must be K/N" in err, err
    more = ("--shard", "1/3", "--seed", "1", "--runs", "2", "--out", str(tmp_path / "o"))
    code, err = finish(capsafe("sweep", "--no-progress", ".", *more, cwd=tmp_path))
    assert code == 2 and "N must be at most --runs" in err, err


@pytest.mark.slow  # sweeps, a resume and a merge
@pytest.mark.timeout(600)
def test_a_shard_the_budget_stopped_is_resumed_before_the_merge(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("def test_a():\n    pass\n")
    shard = tmp_path / "shard-1"
    args = ("sweep", "--no-progress", ".", "--runs", "4", "--workers", "0", "--seed", "1",
            "--shard", "1/2", "--out", str(shard))  # fmt: skip
    code, err = finish(capsafe(*args, "--budget", "0.01", *FAST, cwd=tmp_path))
    assert code == 0 and "stopped after 1 of its 2 runs" in err, err
    code, err = merge(str(tmp_path / "m"), str(shard), cwd=tmp_path)
    assert code == 2 and "did not finish its runs (1 of 2 done)" in err, err
    code, err = finish(capsafe(*args, "--resume", *FAST, cwd=tmp_path))
    assert code == 0 and "done (2 runs" in err, err
    assert json.loads((shard / "sweep.json").read_text())["runs_done"] == [1, 3]
