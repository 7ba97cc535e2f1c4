"""The sweep's outputs: records.jsonl, tests.csv, summary.json, report.md (harness.report.
markdown) and report.html (harness.report.html_page), from the typed Summary; the per-test
table behind the last three is built in harness.report.tables (pandas)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..records import Record, to_json
from ..verdicts.fold import RunOutcome
from . import tables
from .html_page import render_html
from .markdown import render_markdown
from .summary import Summary


def write_reports(
    out: str | os.PathLike[str],
    summary: Summary,
    rows: Iterable[Record],
    grid: Mapping[str, Sequence[str]],
    run_ids: Sequence[str],
    history: Sequence[Mapping[str, str]],
    *,
    ends: Iterable[RunOutcome] = (),
) -> list[dict[str, Any]]:
    """Write every report file into `out` (`ends`: how each test process ended, which the
    rows do not say; `history`: this suite's rows of history.csv); the per-test table they
    were made from (harness.report.tables), for the CI outputs. `rows` is read twice: a
    sweep's store streams them from disk each time, so they are never all in memory."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if iter(rows) is rows:  # a one-pass iterator: kept, to be read twice
        rows = list(rows)
    with open(out / "records.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(to_json(row) + "\n")
    data = summary.to_dict()
    (out / "summary.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tests = tables.per_test_table(summary.tests, tables.outcomes_by_test(rows, ends))
    tables.write_tests_csv(out / "tests.csv", tests)
    (out / "report.md").write_text(render_markdown(summary, tests), encoding="utf-8")
    page = render_html(summary, grid, run_ids, history, tests)
    (out / "report.html").write_text(page, encoding="utf-8")
    return tests
