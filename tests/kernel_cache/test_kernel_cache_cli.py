"""`capsafe cache stats|list|prune|clear` with and without --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsafe.cli import main
from capsafe.kernel_cache import KernelCache, cache_key


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    cache = KernelCache(tmp_path / "cache")
    for n in range(3):
        key = cache_key([f"cli-{n}"])
        meta = {"name": f"k{n}.cu", "arch": "sm_90", "nvrtc": "13.5"}

        def compile_(n: int = n, meta: dict[str, str] = meta) -> tuple[bytes, dict[str, str]]:
            return b"x" * (100 * (n + 1)), meta

        cache.get_or_compile(key, "ptx", compile_)
    past = time.time() - 100  # file times are coarser than these writes: spread them
    for n in range(3):
        os.utime(cache.entry_path(cache_key([f"cli-{n}"])), (past + n, past + n))
    cache.get_or_compile(cache_key(["cli-0"]), "ptx", lambda: pytest.fail("should hit"))
    cache.stats()  # flush the batched hit
    return tmp_path / "cache"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_json(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "stats", "--json", "--dir", str(filled))
    stats = json.loads(out)
    assert code == 0
    assert (stats["entries"], stats["hits"], stats["misses"], stats["compiles"]) == (3, 1, 3, 3)
    assert stats["bytes"] > 600 and stats["budget_bytes"] > 0
    assert stats["directory"] == str(filled) and "saved_seconds" in stats


def test_stats_text_is_friendly(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "stats", "--dir", str(filled))
    assert code == 0
    assert "3 (" in out and "1 hits, 3 misses" in out and "saved" in out


def test_list_shows_entries_least_recently_used_first(
    filled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "list", "--json", "--dir", str(filled))
    rows = json.loads(out)["entries"]
    assert code == 0 and len(rows) == 3
    assert {r["name"] for r in rows} == {"k0.cu", "k1.cu", "k2.cu"}
    assert rows[-1]["name"] == "k0.cu"  # the hit made it the most recently used
    assert all(r["kind"] == "ptx" and r["arch"] == "sm_90" for r in rows)
    _, text, _ = run(capsys, "list", "--dir", str(filled))
    assert "k1.cu" in text and "ptx" in text


def test_prune_and_clear(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "prune", "--json", "--max-bytes", "0", "--dir", str(filled))
    assert code == 0 and json.loads(out)["removed"] == 0  # 0 = unbounded
    code, out, _ = run(capsys, "prune", "--json", "--max-bytes", "1", "--dir", str(filled))
    assert json.loads(out)["removed"] == 3 and json.loads(out)["entries"] == 0
    code, out, _ = run(capsys, "clear", "--dir", str(filled))
    assert code == 0 and "cleared 0 entries" in out
    _, out, _ = run(capsys, "stats", "--json", "--dir", str(filled))
    assert json.loads(out)["hits"] == 0


def test_clear_json(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "clear", "--json", "--dir", str(filled))
    assert json.loads(out)["removed"] == 3


def test_empty_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "list", "--dir", str(tmp_path / "none"))
    assert "no entries" in out


@pytest.mark.parametrize("argv", [["explode"], ["prune", "--max-bytes", "-5"]])
def test_usage_errors_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["cache", *argv])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("capsafe cache: error:")


def test_stats_into_a_closed_pipe_exits_quietly(filled: Path) -> None:
    """`capsafe cache stats | head -1`: the reader is gone before the output is written;
    that printed a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "capsafe.cli", "cache", "stats", "--dir", str(filled)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")
