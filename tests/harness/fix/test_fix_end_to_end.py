"""Issue 25's done-when on the planted fix suites (repro/suites/fix_*): `capsafe sweep --fix`
gives a verified patch for every victim, of the kind its key names (an idiom for a polluter
whose leftover the sweep can name, the state-setter's or the cleaner's statements otherwise),
and finds the cleaner where the key names one; `capsafe fix OUT` applies them, and the suite
then sweeps clean. A patch that does not fix its victim fails the last sweep, whatever the
engine claimed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SUITES = Path(__file__).resolve().parents[3] / "repro" / "suites"
FIX_KEYS = sorted(
    k for k in SUITES.glob("fix_*/answer_key.json") if json.loads(k.read_text())["fix"]
)
FAST = ["--", "-p", "no:run-parallel", "-p", "no:hypothesispytest"]  # lighter test processes


def capsafe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsafe.cli", *args], capture_output=True,
                          text=True, timeout=540)  # fmt: skip


def sweep(suite: Path, out: Path, options: dict[str, Any], *extra: str) -> dict[str, Any]:
    args = ["--timeout", "10", *extra]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    done = capsafe("sweep", "--no-progress", str(suite), "--out", str(out), *args, *FAST)
    assert done.returncode in (0, 1), done.stderr
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return {"exit": done.returncode, **summary}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("key_path", FIX_KEYS, ids=[k.parent.name for k in FIX_KEYS])
def test_every_victim_gets_a_patch_that_sweeps_clean(key_path: Path, tmp_path: Path) -> None:
    key = json.loads(key_path.read_text())
    suite = tmp_path / key_path.parent.name  # `capsafe fix` edits it: a copy
    shutil.copytree(key_path.parent, suite)
    before = {p.name: p.read_text() for p in suite.glob("*.py")}
    swept = sweep(suite, tmp_path / "fixed", key["sweep"], "--fix")
    found = {t["nodeid"]: t for t in swept["tests"]}
    for nodeid, want in key["tests"].items():
        assert found[nodeid]["classification"] == want["classification"], nodeid
        assert found[nodeid]["fix"] is not None, (nodeid, swept["fixes"], swept["notes"])
        assert found[nodeid]["cleaners"] == want.get("cleaners", []), nodeid
        assert found[nodeid]["fix"]["source"] == want["fix_source"], found[nodeid]["fix"]
    assert [f["victim"] for f in swept["fixes"] if f["patched"]] == sorted(key["tests"])
    assert len(list((tmp_path / "fixed" / "fixes").glob("*.patch"))) == len(key["tests"])
    report = (tmp_path / "fixed" / "report.md").read_text()
    assert report.count("```diff") == len(key["tests"])

    applied = capsafe("fix", str(tmp_path / "fixed"))
    assert applied.returncode == 0, applied.stderr
    changed = [p.name for p in suite.glob("*.py") if p.read_text() != before[p.name]]
    assert changed, applied.stderr

    again = sweep(suite, tmp_path / "after", key["sweep"])
    not_passing = {t["nodeid"]: t["classification"] for t in again["tests"]
                   if t["classification"] != "pass"}  # fmt: skip
    assert again["exit"] == 0 and not not_passing, (not_passing, applied.stderr)
    assert set(key["tests"]) <= {t["nodeid"] for t in again["tests"]}  # the victims still ran
