"""Report files, the HTML page, history.csv and the `latest` pointer, from synthetic summaries."""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import pytest

from capsafe_harness.records import Record
from capsafe_harness.report import history, tables
from capsafe_harness.report.html_page import render_html
from capsafe_harness.report.markdown import render_markdown
from capsafe_harness.report.render import write_reports
from capsafe_harness.report.rows import ReportRows
from capsafe_harness.report.shared import pairs, search_bound
from capsafe_harness.report.summary import SearchRecord, Summary, TestVerdict
from capsafe_harness.verdicts.catalogue import CLASSES
from capsafe_harness.verdicts.fold import RunOutcome

SUITE = "/home/me/proj/tests"


def append(
    path: Path,
    sweep_id: str,
    timestamp: str,
    verdicts: Iterable[history.Verdict],
    suite: str = SUITE,
) -> list[dict[str, str]]:
    return history.append_history(path, sweep_id, timestamp, verdicts, suite=suite)


def entry(
    nodeid: str, classification: str = "pass", runs: int = 4, failures: int = 0, **kw: Any
) -> dict[str, Any]:
    base = {"nodeid": nodeid, "classification": classification, "runs": runs,
            "failures": failures, "flake_rate": failures / runs,
            "flake_rate_ci": [0.0, 0.49], "isolation_runs": 0, "isolation_failures": 0,
            "polluters": [], "state_setters": [], "signals": [], "replay": ""}  # fmt: skip
    return {**base, **kw}


def summary(
    tests: Iterable[dict[str, Any]],
    searches: Iterable[dict[str, Any]] = (),
    notes: Iterable[str] = (),
) -> Summary:
    """A typed Summary, as the sweep hands the report, from the entries' fields."""
    verdicts = [TestVerdict(**{**VERDICT_DEFAULTS, **t, "flake_rate_ci": tuple(t["flake_rate_ci"])})
                for t in tests]  # fmt: skip
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.classification] = counts.get(v.classification, 0) + 1
    found = [SearchRecord(**{**SEARCH_DEFAULTS, **s}) for s in searches]
    return Summary(runs=4, workers=2, seeds=[1, 2, 3, 4], shuffles=["global", "module"] * 2,
                   backend="sim", duration_s=12.5,
                   tests=verdicts, counts=counts, searches=found, notes=list(notes))  # fmt: skip


VERDICT_DEFAULTS: dict[str, Any] = {"why": "", "detection_chance": None, "unconfirmed": [],
                                    "concurrent": [], "message": ""}  # fmt: skip
SEARCH_DEFAULTS: dict[str, Any] = {"kind": "polluter", "verification_replays": 0,
                                   "culprits": [], "verified": False, "capped": False}  # fmt: skip


TESTS = [
    entry("t.py::test_ok"),
    entry("t.py::test_victim", "order-dependent", failures=2, isolation_runs=3,
          polluters=["t.py::test_polluter"], replay="cd /x && python -m pytest ..."),
    entry("t.py::test_polluter"),
    entry("t.py::test_needs_setup", "brittle", failures=3, isolation_runs=3,
          isolation_failures=3, state_setters=["t.py::test_setup"], replay="r"),
    entry("t.py::test_boom[<b>]", "fail", failures=4, isolation_runs=3, isolation_failures=3,
          signals=["crash"], replay="r"),
    entry("t.py::test_coin", "flaky", failures=1, isolation_runs=3, isolation_failures=1,
          replay="r"),
]  # fmt: skip
GRID = {
    "t.py::test_ok": ["passed"] * 4,
    "t.py::test_victim": ["passed", "failed", "failed", "passed"],
    "t.py::test_polluter": ["passed"] * 4,
    "t.py::test_needs_setup": ["failed", "failed", "passed", "failed"],
    "t.py::test_boom[<b>]": ["crash", "crash", "crash", "crash"],
    "t.py::test_coin": ["passed", "timeout", "passed", "none"],
}
RUNS = ["run-1", "run-2", "run-3", "run-4"]


def read(rows: list[Record], out: Path) -> ReportRows:
    """The rows as the sweep reads them for its reports, records.jsonl written into `out`."""
    runs: dict[str, list[Record]] = {}
    for row in rows:
        runs.setdefault(row["run_id"], []).append(row)
    found = ReportRows()
    with open(out / "records.jsonl", "w", encoding="utf-8") as records:
        for run, run_rows in runs.items():
            found.add(RunOutcome(run, 0), run_rows, records)
    return found


def test_write_reports_writes_every_file(tmp_path: Path) -> None:
    rows = [cast(Record, {"nodeid": "t.py::test_ok", "phase": "call", "outcome": "passed",
             "duration": 0.0, "run_id": "run-1", "seed": 1, "worker": "gw0", "index": 0,
             "pid": 1, "signals": [], "message": "", "time": 0.0})]  # fmt: skip
    write_reports(tmp_path, summary(TESTS), read(rows, tmp_path), GRID, RUNS, [])
    for name in ("records.jsonl", "tests.csv", "summary.json", "report.md", "report.html"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "records.jsonl").read_text())["nodeid"] == "t.py::test_ok"
    assert json.loads((tmp_path / "summary.json").read_text())["backend"] == "sim"
    with open(tmp_path / "tests.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(TESTS)
    victim = next(r for r in table if r["nodeid"] == "t.py::test_victim")
    assert victim["polluters"] == "t.py::test_polluter"
    assert {"ci_low", "ci_high", "isolation_failures", "replay"} <= set(victim)


def test_html_is_self_contained_and_escaped() -> None:
    page = render_html(summary(TESTS), GRID, RUNS, [])
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page
    assert "test_boom[&lt;b&gt;]" in page and "test_boom[<b>]" not in page
    assert "<svg" in page  # flake-rate bars with their interval whiskers


def test_html_sorts_worst_first_and_shows_causes_and_heat_map() -> None:
    page = render_html(summary(TESTS), GRID, RUNS, [])
    table = page[page.index("Tests, worst first") : page.index("passing tests</summary>")]
    order = [table.index(n) for n in ("test_boom", "test_victim", "test_needs_setup", "test_coin")]
    assert order == sorted(order)
    assert "Failure heat map" in page and 'class="hc crash"' in page
    assert 'class="hc timeout"' in page
    assert "4 of 6 tests failed in at least one run" in page
    assert "Polluter → victim" in page and "breaks" in page and "sets up" in page
    assert "4 of 6 tests need attention" in page or "need attention" in page


def test_all_passing_page_says_so() -> None:
    tests = [entry("a.py::t"), entry("a.py::u")]
    page = render_html(summary(tests), {"a.py::t": ["passed"] * 4}, RUNS, [])
    assert "All 2 tests pass." in page
    assert "Polluter" not in page


def test_notes_and_searches_are_shown() -> None:
    s = summary(TESTS, searches=[{"victim": "t.py::test_victim", "candidates": 16,
                                  "replays": 7}], notes=["budget of 5s spent"])  # fmt: skip
    page = render_html(s, GRID, RUNS, [])
    assert "budget of 5s spent" in page and "within" in page
    md = render_markdown(s)
    assert "| `t.py::test_victim` | 16 | 7 | 7 |" in md
    assert "> **Note:** budget of 5s spent" in md
    assert "order-dependent" in md and "after t.py::test_polluter" in md


def test_trend_sparklines_come_from_history(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    for i, rate in enumerate([0.0, 0.25, 0.5]):
        append(path, f"s{i}", f"2026-01-0{i + 1}", [
            history.Verdict("t.py::test_victim", "order-dependent" if rate else "pass", 4,
                            int(rate * 4), rate)])  # fmt: skip
    page = render_html(summary(TESTS), GRID, RUNS, history.read_history(path))
    assert "<polyline" in page and "not passing, last 3 sweeps" in page


def test_pairs_and_search_bound() -> None:
    found = pairs(TESTS)
    assert ("polluter", ["t.py::test_polluter"], "t.py::test_victim") in found
    assert ("state-setter", ["t.py::test_setup"], "t.py::test_needs_setup") in found
    assert search_bound(1) == 3 and search_bound(16) == 7 and search_bound(17) == 8


# ---------------------------------------------------------------- history


def test_history_appends_and_tracks_first_and_last_seen(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    v = history.Verdict
    append(path, "a", "T1", [v("x", "pass", 5, 0, 0.0), v("y", "flaky", 5, 1, 0.2)])
    append(path, "b", "T2", [v("x", "flaky", 5, 2, 0.4), v("y", "pass", 5, 0, 0)])
    rows = append(path, "c", "T3", [v("x", "pass", 5, 0, 0.0)])
    assert len(rows) == 5 and len(history.read_history(path)) == 5
    last_x = [r for r in rows if r["nodeid"] == "x"][-1]
    assert (last_x["first_seen"], last_x["last_seen"]) == ("T2", "T2")
    last_y = [r for r in rows if r["nodeid"] == "y"][-1]
    assert (last_y["first_seen"], last_y["last_seen"]) == ("T1", "T1")
    assert tables.trends(rows)["x"] == [0.0, 0.4, 0.0]
    with open(path) as f:
        assert f.readline().strip().split(",") == list(history.COLUMNS)


def test_latest_is_a_relative_symlink_that_moves(tmp_path: Path) -> None:
    first, second = tmp_path / "s1", tmp_path / "s2"
    first.mkdir()
    second.mkdir()
    history.point_latest(first)
    latest = history.point_latest(second)
    assert latest.is_symlink() and os.readlink(latest) == "s2"


def test_latest_falls_back_to_a_text_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "s1"
    out.mkdir()

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("symlinks not allowed here")

    monkeypatch.setattr(os, "symlink", refuse)  # the module history calls
    latest = history.point_latest(out)
    assert latest.read_text().strip() == str(out.resolve())


@pytest.mark.parametrize("bad", ["nodeid,flake_rate\nx,notanumber\n", ""])
def test_trends_skip_unreadable_rates(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "history.csv"
    path.write_text(bad)
    assert tables.trends(history.read_history(path)) == {}


def test_history_row_cut_short_is_dropped_and_the_next_sweep_starts_a_new_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "history.csv"
    v = history.Verdict
    append(path, "a", "T1", [v("x", "flaky", 5, 1, 0.2)])
    with open(path, "a") as f:
        f.write("b,T2,x,fla")  # a writer killed mid-row
    rows = append(path, "c", "T3", [v("x", "pass", 5, 0, 0.0)])
    assert [r["sweep_id"] for r in rows] == ["a", "c"]
    assert [r["sweep_id"] for r in history.read_history(path)] == ["a", "c"]


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00\x01 binary junk\n", b"nodeid,flake_rate\nx,0.5\n"]
)
def test_history_that_is_not_a_history_file_is_refused_untouched_and_set_aside(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "history.csv"
    path.write_bytes(content)
    with pytest.raises(history.HistoryError, match=r"history\.csv"):
        append(path, "a", "T1", [history.Verdict("x", "pass", 1, 0, 0.0)])
    assert path.read_bytes() == content
    aside = history.set_aside(path)
    assert aside.read_bytes() == content and not path.exists()
    path.write_bytes(content)
    assert history.set_aside(path) != aside and aside.exists()


def test_latest_that_is_a_real_directory_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "s1"
    out.mkdir()
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is a directory"):
        history.point_latest(out)
    assert (tmp_path / "latest" / "keep.txt").read_text() == "mine"


def test_latest_that_is_a_file_becomes_the_link(tmp_path: Path) -> None:
    out = tmp_path / "s1"
    out.mkdir()
    (tmp_path / "latest").write_text("stale\n")
    assert history.point_latest(out).resolve() == out.resolve()


# ---------------------------------------------------------------- problem 10: what a person reads


def rec(
    nodeid: str,
    phase: str,
    outcome: str,
    run: str = "run-1",
    message: str = "",
    details: str = "",
    time: float = 1.0,
    **kw: Any,
) -> Record:
    """A record as the plugin writes it, less `gpu`; `kw`: more fields or other values."""
    return cast(Record, {"nodeid": nodeid, "phase": phase, "outcome": outcome, "duration": 0.1,
            "run_id": run, "seed": 1, "worker": "gw0", "index": 0, "pid": 1, "signals": [],
            "message": message, "details": details, "start": time - 0.1, "stop": time,
            "time": time, **kw})  # fmt: skip


def phases(
    nodeid: str,
    call: str = "passed",
    run: str = "run-1",
    message: str = "",
    details: str = "",
    setup: str = "passed",
    **kw: Any,
) -> list[Record]:
    return [rec(nodeid, "setup", setup, run, message if setup != "passed" else "", details),
            rec(nodeid, "call", call, run, message if call != "passed" else "", details),
            rec(nodeid, "teardown", "passed", run, **kw)]  # fmt: skip


TRACEBACK = "def test_boom():\n>       assert compute() == 3\nE       assert 2 == 3\n" + "x\n" * 50
REPORT_ROWS = [
    *phases("t.py::test_boom[<b>]", "failed", message="assert 2 == 3\n+  where 2 = compute()",
            details=TRACEBACK),
    *phases("t.py::test_boom[<b>]", "failed", run="run-2", message="an older failure",
            details="older", ),
    *phases("t.py::test_skip", setup="skipped", call="passed", message="Skipped: needs a GPU"),
    *phases("t.py::test_known", "xfailed", message="AssertionError: known bug #12"),
    *phases("t.py::test_fixed", "xpassed", message="expected to fail (fixed upstream?)"),
    *phases("t.py::test_ok", signals=["env-leak"],
            env_leak={"CUDA_VISIBLE_DEVICES": ["0", "1"], "CAPSAFE_X": [None, "on"]}),
]  # fmt: skip
REPORT_TESTS = [
    entry("t.py::test_ok", signals=["env-leak"]),
    entry("t.py::test_boom[<b>]", "fail", failures=4, isolation_runs=3, isolation_failures=3,
          replay="r"),
    entry("t.py::test_skip"),
    entry("t.py::test_known"),
    entry("t.py::test_fixed"),
]  # fmt: skip


def test_outcomes_by_test_folds_attempts_and_keeps_the_latest_message() -> None:
    rows = [*REPORT_ROWS, *phases("t.py::test_boom[<b>]", "passed", run="run-0")]
    found = tables.outcomes_by_test(rows)
    assert found.loc["t.py::test_boom[<b>]", "outcome"] == "failed"
    assert found.loc["t.py::test_boom[<b>]", "outcomes"] == {"failed": 2, "passed": 1}
    assert found.loc["t.py::test_boom[<b>]", "message"] == "an older failure"  # latest by time
    assert found.loc["t.py::test_skip", "outcome"] == "skipped"
    assert found.loc["t.py::test_skip", "message"] == "Skipped: needs a GPU"
    assert found.loc["t.py::test_known", "outcome"] == "xfailed"
    assert found.loc["t.py::test_fixed", "outcome"] == "xpassed"
    assert found.loc["t.py::test_ok", "outcome"] == "passed"
    assert sorted(found.loc["t.py::test_ok", "env_leaks"]) == [
        ["CAPSAFE_X", None, "on"], ["CUDA_VISIBLE_DEVICES", "0", "1"]]  # fmt: skip
    assert tables.outcomes_by_test([]).empty


def report_files(tmp_path: Path) -> tuple[str, str]:
    rows = [r for r in REPORT_ROWS if r["run_id"] == "run-1"]
    write_reports(tmp_path, summary(REPORT_TESTS), read(rows, tmp_path), {}, ["run-1"], [])
    return (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()


def test_reports_show_every_failure_message_first_lines_and_full_output_folded(
    tmp_path: Path,
) -> None:
    md, page = report_files(tmp_path)
    assert "### `t.py::test_boom[<b>]` (fail)" in md
    assert "```text\nassert 2 == 3\n+  where 2 = compute()\n```" in md
    assert "<details><summary>full output</summary>" in md and "E       assert 2 == 3" in md
    assert '<pre class="msg">assert 2 == 3\n+  where 2 = compute()</pre>' in page
    assert '<details class="full"><summary>full output</summary><pre>def test_boom():' in page
    assert "&lt;b&gt;" in page and "<b>]" not in page  # node ids and output escaped


def test_reports_show_skipped_xfailed_xpassed_as_their_own_outcomes(tmp_path: Path) -> None:
    md, page = report_files(tmp_path)
    assert "Outcomes of the tests classed pass: passed 1 · skipped 1 · xfailed 1 · xpassed 1" in md
    assert "| `t.py::test_skip` | skipped | skipped 1 | Skipped: needs a GPU |" in md
    assert "| `t.py::test_known` | xfailed | xfailed 1 | AssertionError: known bug #12 |" in md
    assert "| `t.py::test_fixed` | xpassed |" in md
    assert "<h2>Skipped, xfailed and xpassed</h2>" in page
    for outcome in ("skipped", "xfailed", "xpassed"):
        assert f"{outcome}</span>" in page
    assert "Skipped: needs a GPU" in page and "known bug #12" in page
    with open(tmp_path / "tests.csv", newline="") as f:
        outcomes = {r["nodeid"]: r["outcome"] for r in csv.DictReader(f)}
    assert outcomes == {"t.py::test_ok": "passed", "t.py::test_boom[<b>]": "failed",
                       "t.py::test_skip": "skipped", "t.py::test_known": "xfailed",
                       "t.py::test_fixed": "xpassed"}  # fmt: skip


def test_reports_show_env_leaks_of_passing_tests_with_both_values(tmp_path: Path) -> None:
    md, page = report_files(tmp_path)
    assert "| `t.py::test_ok` | pass | `CUDA_VISIBLE_DEVICES` | `0` | `1` |" in md
    assert "| `t.py::test_ok` | pass | `CAPSAFE_X` | unset | `on` |" in md
    assert "<h2>Environment left changed</h2>" in page
    assert "<td><code>CUDA_VISIBLE_DEVICES</code></td><td><code>0</code></td>" in page
    with open(tmp_path / "tests.csv", newline="") as f:
        leaks = {r["nodeid"]: r["env_leaks"] for r in csv.DictReader(f)}
    assert leaks["t.py::test_ok"] == "CAPSAFE_X: unset -> 'on';CUDA_VISIBLE_DEVICES: '0' -> '1'"


def test_a_message_with_backtick_fences_stays_inside_its_block() -> None:
    t = entry("t.py::t", "fail", failures=4, replay="r", message="```\nnot the end")
    md = render_markdown(summary([t]))
    assert "````text\n```\nnot the end\n````" in md


# ---------------------------------------------------------------- problem 11: history per suite


def test_history_is_keyed_by_suite_so_siblings_sharing_a_reports_dir_keep_their_own_trend(
    tmp_path: Path,
) -> None:
    path = tmp_path / "history.csv"
    v = history.Verdict
    append(path, "a1", "T1", [v("tests/test_x.py::t", "flaky", 4, 1, 0.25)], suite="/p/a")
    append(path, "b1", "T2", [v("tests/test_x.py::t", "pass", 4, 0, 0.0)], suite="/p/b")
    rows_b = append(path, "b2", "T3", [v("tests/test_x.py::t", "pass", 4, 0, 0.0)], suite="/p/b")
    assert [r["sweep_id"] for r in rows_b] == ["b1", "b2"]
    assert tables.trends(rows_b) == {"tests/test_x.py::t": [0.0, 0.0]}
    assert rows_b[-1]["first_seen"] == ""  # suite a's failure is not suite b's
    rows_a = append(path, "a2", "T4", [v("tests/test_x.py::t", "pass", 4, 0, 0.0)], suite="/p/a")
    assert [r["sweep_id"] for r in rows_a] == ["a1", "a2"]
    assert (rows_a[-1]["first_seen"], rows_a[-1]["last_seen"]) == ("T1", "T1")
    assert tables.not_passing_per_sweep(rows_a) == [1, 0]
    assert len(history.read_history(path)) == 4


def test_history_of_the_older_format_is_kept_with_an_unknown_suite(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    path.write_text(",".join(history.OLDER_COLUMNS) + "\nold,T0,x,flaky,4,1,0.25,T0,T0\n")
    rows = append(path, "new", "T1", [history.Verdict("x", "pass", 4, 0, 0.0)], suite="/p")
    assert [r["sweep_id"] for r in rows] == ["new"]
    kept = history.read_history(path)
    assert [(r["suite"], r["sweep_id"]) for r in kept] == [("", "old"), ("/p", "new")]


def test_suite_key_is_the_absolute_paths_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert history.suite_key(["b", "a"]) == f"{tmp_path / 'a'} {tmp_path / 'b'}"


def test_reports_give_the_sweeps_words_and_detection_chance_for_each_verdict(
    tmp_path: Path,
) -> None:
    t = entry("t.py::t", "parallel-unsafe", failures=2, replay="r", message="boom",
              why="failed 2 of 4 suite runs beside other workers; passed alone 3 of 3",
              detection_chance=0.9375, concurrent=["t.py::other"])  # fmt: skip
    md = render_markdown(summary([t]))
    assert "failed 2 of 4 suite runs beside other workers; passed alone 3 of 3" in md
    assert "Chance a sweep of 4 runs shows it: 94%" in md
    assert "beside t.py::other" in md
    page = render_html(summary([t]), {}, RUNS, [])
    assert '<span class="muted">beside</span> <code class="t">t.py::<wbr>other</code>' in page
    assert '<div class="why">Chance a sweep of 4 runs shows it: 94%</div>' in page


def test_html_at_a_glance_zero_classes_replay_and_names() -> None:
    """The classes no test is in share one line (they took a card each, eight of nine
    rows of zeros); the replay command is on the page, not folded; node ids wrap only
    after `/` and `::`."""
    t = entry("tests/unit/t.py::TestA::test_victim", "order-dependent", failures=1,
              replay="python -m pytest --capsafe-replay=reports/x/replays/v.txt")  # fmt: skip
    page = render_html(summary([t, entry("a.py::ok")]), {}, RUNS, [])
    cards = re.findall(r'<div class="k">([^<]+)</div>', page)
    assert sorted(cards) == ["order-dependent", "pass"]
    zero = re.search(r'<p class="zero">(.*?)</p>', page)
    assert zero is not None
    assert re.findall(r'class="z"[^>]*>([^<]+)<', zero.group(1)) == [
        c for c in CLASSES if c not in ("pass", "order-dependent")
    ]
    assert "<pre>python -m pytest --capsafe-replay=reports/x/replays/v.txt</pre>" in page
    assert "<summary>replay</summary>" not in page
    assert "tests/<wbr>unit/<wbr>t.py::<wbr>TestA::<wbr>test_victim" in page
    assert "code.t{overflow-wrap:break-word;word-break:normal}" in page
