"""pytest-randomly installed beside capsafe: the same seed gives the same orders, the same
`random` stream and the same verdicts as without it (harness.plugin.randomly).

pytest-randomly is installed for these tests only, with pip into a --target directory
put on PYTHONPATH (the project's own environment does not load it: it would reorder
every planted suite the other tests run); marked `install`, so .ci/run runs them, and
they skip with the reason where pip cannot get it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.install

SUITE = """
    import os
    import random

    import pytest

    STATE = []

    def _draw(name):
        with open(os.environ["RANDOM_LOG"], "a") as f:
            f.write(f"{name} {random.random()!r}\\n")

    @pytest.mark.parametrize("i", range(6))
    def test_draw(i):
        _draw(f"{__name__}::test_draw[{i}]")

    def test_polluter():
        STATE.append(1)

    def test_victim():
        _draw(f"{__name__}::test_victim")
        assert not STATE

    class TestGroup:
        def test_a(self):
            _draw(f"{__name__}::TestGroup::test_a")

        def test_b(self):
            _draw(f"{__name__}::TestGroup::test_b")
"""


@pytest.fixture(scope="module")
def randomly_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pytest-randomly installed into a directory of its own."""
    target = tmp_path_factory.mktemp("randomly")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         "pytest-randomly>=3.15"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"pip could not install pytest-randomly: {done.stderr.strip()[-300:]}")
    return target


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    root = tmp_path / "suite"
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\n")
    for name in ("test_one.py", "test_two.py"):
        (root / name).write_text(textwrap.dedent(SUITE))
    return root


def _env(log: Path, randomly: Path | None) -> dict[str, str]:
    env = {**os.environ, "RANDOM_LOG": str(log)}
    env.pop("PYTHONPATH", None)
    if randomly is not None:
        env["PYTHONPATH"] = str(randomly)
    return env


def _sweep(suite: Path, out: Path, log: Path, randomly: Path | None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", str(suite), "--runs",
         "3", "--workers", "2", "--seed", "11", "--out", str(out), "--",
         "-p", "no:hypothesispytest"],
        cwd=suite.parent, env=_env(log, randomly), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # the planted victims


def _orders(out: Path) -> dict[str, list[tuple[str, int, str]]]:
    """Per suite run: (worker, position, test) of every test."""
    found: dict[str, list[tuple[str, int, str]]] = {}
    for line in (out / "records.jsonl").read_text().splitlines():
        row: Mapping[str, Any] = json.loads(line)
        if row["run_id"].startswith("run-") and row["phase"] == "call":
            found.setdefault(row["run_id"], []).append((row["worker"], row["index"], row["nodeid"]))
    return {run: sorted(rows) for run, rows in found.items()}


def test_a_sweep_with_and_without_pytest_randomly_is_the_same(
    suite: Path, randomly_dir: Path, tmp_path: Path
) -> None:
    # pytest-randomly reordered before capsafe's shuffle and reseeded `random` after
    # capsafe, each run with a fresh seed: neither the order nor the stream followed the seed.
    _sweep(suite, tmp_path / "without", tmp_path / "without.log", None)
    _sweep(suite, tmp_path / "with", tmp_path / "with.log", randomly_dir)
    without, with_ = _orders(tmp_path / "without"), _orders(tmp_path / "with")
    assert len(without) == 3 and without == with_
    # The same draws: every process's `random` follows its seed with randomly as without.
    # Compared as sets: the screens after the runs (alone runs, a cause replayed before
    # every other test) replay some tests more than once with one seed, and how many such
    # replays a sweep makes is not what this test is about (a clean CI had 12 more lines
    # without randomly than with it, every one a repeat of a value drawn in both).
    draws = set((tmp_path / "without.log").read_text().splitlines())
    assert draws and draws == set((tmp_path / "with.log").read_text().splitlines())
    summaries = [
        json.loads((tmp_path / d / "summary.json").read_text()) for d in ("without", "with")
    ]
    verdicts = [{t["nodeid"]: t["classification"] for t in s["tests"]} for s in summaries]
    assert verdicts[0] == verdicts[1]
    assert verdicts[0]["test_one.py::test_victim"] == "order-dependent"
    # loaded in the suite's pytest, as its collection saw it
    assert any(n.startswith("pytest-randomly is installed") for n in summaries[1]["notes"])
    assert not any("pytest-randomly" in n for n in summaries[0]["notes"])


@pytest.mark.parametrize("workers", ["0", "2"])
def test_the_plugins_seed_fixes_order_and_stream_beside_pytest_randomly(
    suite: Path, randomly_dir: Path, tmp_path: Path, workers: str
) -> None:
    """`pytest -p capsafe --capsafe-seed S` on its own, as the README shows it."""
    outputs: list[tuple[list[str], list[str]]] = []
    for randomly in (None, randomly_dir, randomly_dir):  # twice with: its seeds would differ
        log = tmp_path / f"{len(outputs)}.log"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", str(suite), "-p", "capsafe", "--capsafe-seed=7",
             f"-n={workers}", "-v", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"],
            cwd=suite.parent, env=_env(log, randomly), capture_output=True, text=True,
            timeout=240, check=False,
        )  # fmt: skip
        order = [line.split(" ")[0] for line in done.stdout.splitlines() if " PASSED" in line]
        if workers == "0":  # one process: its order is the run's
            outputs.append((order, log.read_text().splitlines()))
        else:
            outputs.append((sorted(order), sorted(log.read_text().splitlines())))
        if randomly is not None:
            assert "pytest-randomly: seed 7, reordering and per-test reseeding off" in done.stdout
    assert outputs[0][0] and outputs[0] == outputs[1] == outputs[2]
