"""Problem 11: one seed, one run: numpy and registered generators reseeded, one worker split."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from capsafe_harness.plugin import order
from capsafe_harness.plugin.schedule import deal
from capsafe_harness.plugin.seeding import seed32
from capsafe_harness.records import Record, read_records

pytest_plugins = ["pytester"]
RunLean = Callable[..., pytest.RunResult]


@pytest.fixture
def run_lean(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> RunLean:
    """Subprocess runs with only capsafe's plugin and xdist: no other plugin reseeds or splits."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    # Prepended, not replaced: where capsafe is importable only through PYTHONPATH (a wheel
    # unpacked into a directory, as on the GPU host), replacing it lost capsafe.
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pytester.path), inherited])))

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest_subprocess(
            "-p", "xdist.plugin", "-p", "capsafe_harness.plugin", "-p", "no:cacheprovider", *args
        )

    return run


def worker_sequences(directory: Path) -> dict[str, list[str]]:
    """Per worker, the node ids it ran, in its order (call rows only)."""
    calls: list[Record] = [r for r in read_records(directory) if r["phase"] == "call"]
    sequences: dict[str, list[str]] = {}
    for row in sorted(calls, key=lambda r: (r["worker"], r["index"])):
        sequences.setdefault(row["worker"], []).append(row["nodeid"])
    return sequences


def test_numpy_global_generator_is_reseeded_per_test(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    pytest.importorskip("numpy")
    draws = tmp_path / "draws"
    pytester.makepyfile(
        test_np=f"""
        import numpy as np
        def test_first(): np.random.random()
        def test_draw(request):
            with open({str(draws)!r}, "a") as f:
                f.write(f"{{np.random.random()!r}} {{np.random.randint(1 << 30)}}\\n")
        """
    )
    both = tmp_path / "both.txt"
    both.write_text("test_np.py::test_first\ntest_np.py::test_draw\n")
    alone = tmp_path / "alone.txt"
    alone.write_text("test_np.py::test_draw\n")
    for replay in (both, alone):
        run_lean("-n", "0", "--capsafe-seed=11", f"--capsafe-replay={replay}").assert_outcomes(
            passed=len(replay.read_text().split())
        )
    run_lean("-n", "0", "--capsafe-seed=12", f"--capsafe-replay={alone}")
    after_other, alone_draw, other_seed = draws.read_text().splitlines()
    assert after_other == alone_draw != other_seed


def test_registered_random_seeders_get_the_per_test_seed(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    """A generator registered for pytest-randomly (`pytest_randomly.random_seeder`) is reseeded
    before every phase of every test, with a value fixed by (seed, node id)."""
    log = tmp_path / "seeds"
    pytester.makepyfile(
        my_seeder=f"""
        def reseed(seed):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{seed}}\\n")
        """,
        test_two="def test_a(): pass\ndef test_b(): pass\n",
    )
    dist_info = pytester.path / "my_seeder-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-seeder\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[pytest_randomly.random_seeder]\nmine = my_seeder:reseed\n"
    )
    run_lean("-n", "0", "--capsafe-seed=4", "--capsafe-shuffle=none").assert_outcomes(passed=2)
    expected = [
        str(seed32(order.per_test_seed(4, f"test_two.py::{name}")))
        for name in ("test_a", "test_b")
        for _phase in range(3)
    ]
    assert log.read_text().split() == expected


SLOW_SUITE = """
import os, time, pytest
SLOW = set(os.environ.get("SLOW_TESTS", "").split(","))
@pytest.mark.parametrize("i", range(16))
def test_t(i):
    if str(i) in SLOW:
        time.sleep(0.25)
"""


def test_seed_fixes_which_worker_runs_which_test(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same seed, same -n: the same per-worker sequences, however long each test takes
    (xdist's load scheduler hands the next test to whichever worker is free first)."""
    pytester.makepyfile(test_slow=SLOW_SUITE)
    seen = []
    for n, slow in enumerate(("0,1,2,3,4,5", "10,11,12,13,14,15")):
        monkeypatch.setenv("SLOW_TESTS", slow)
        records = tmp_path / f"run{n}"
        run_lean("-n", "2", "--capsafe-seed=3", f"--capsafe-records={records}").assert_outcomes(
            passed=16
        )
        seen.append(worker_sequences(records))
    assert seen[0] == seen[1]
    assert sorted(seen[0]) == ["gw0", "gw1"]
    ordered = order.shuffled([f"test_slow.py::test_t[{i}]" for i in range(16)], 3, "global")
    assert seen[0] == {f"gw{k}": [ordered[i] for i in part] for k, part in enumerate(deal(16, 2))}

    monkeypatch.setenv("SLOW_TESTS", "")
    other = tmp_path / "seed4"
    run_lean("-n", "2", "--capsafe-seed=4", f"--capsafe-records={other}")
    assert worker_sequences(other) != seen[0]


def test_a_crashed_workers_remaining_tests_go_in_order_to_its_replacement(
    pytester: pytest.Pytester, tmp_path: Path, run_lean: RunLean
) -> None:
    pytester.makepyfile(
        test_crash="""
        import os, pytest
        @pytest.mark.parametrize("i", range(8))
        def test_t(i):
            if i == 2:
                os._exit(1)
        """
    )
    ordered = [f"test_crash.py::test_t[{i}]" for i in range(8)]
    runs = []
    for n in range(2):
        records = tmp_path / f"run{n}"
        result = run_lean(
            "-n", "2", "--capsafe-seed=0", "--capsafe-shuffle=none", f"--capsafe-records={records}"
        )
        result.assert_outcomes(passed=7, failed=1)
        runs.append(worker_sequences(records))
    assert runs[0] == runs[1]
    crashed = ordered[2]
    dealt = {f"gw{k}": [ordered[i] for i in part] for k, part in enumerate(deal(8, 2))}
    # gw0 was dealt 0, 2, 4, 6 and died in 2; its replacement gw2 runs 4 and 6.
    assert runs[0]["gw1"] == dealt["gw1"]
    assert runs[0]["gw0"] == dealt["gw0"][:2]  # the crash row is the controller's
    assert runs[0]["gw2"] == [t for t in dealt["gw0"] if t not in (ordered[0], crashed)]


def test_deal_is_round_robin_and_covers_every_index_once() -> None:
    assert deal(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert deal(2, 4) == [[0], [1], [], []]
    parts = deal(50, 8)
    assert sorted(i for part in parts for i in part) == list(range(50))


def test_seed32_depends_on_every_word_and_fits_numpy() -> None:
    assert seed32(5) == 5
    assert seed32((7 << 32) ^ 9) == 7 ^ 9
    assert seed32(order.per_test_seed(1, "a")) != seed32(order.per_test_seed(2, "a"))
    assert all(0 <= seed32(order.per_test_seed(s, "x")) < 2**32 for s in (0, 1, 2**40))
