"""The sweep's outputs: records.jsonl (harness.report.rows), tests.csv, summary.json,
report.md (harness.report.markdown) and report.html (harness.report.html_page), from the
typed Summary; the per-test table behind the last three is built in harness.report.tables
(pandas) from the rows read once (harness.report.rows)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import tables
from .html_page import render_html
from .markdown import render_markdown
from .rows import ReportRows
from .summary import Summary


def write_reports(
    out: str | os.PathLike[str],
    summary: Summary,
    rows: ReportRows,
    grid: Mapping[str, Sequence[str]],
    run_ids: Sequence[str],
    history: Sequence[Mapping[str, str]],
) -> list[dict[str, Any]]:
    """Write every report file but records.jsonl (harness.report.rows writes it as it reads
    the rows) into `out` (`rows`: what the reports need of the rows; `history`: this
    suite's rows of history.csv); the per-test table they were made from
    (harness.report.tables), for the CI outputs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = summary.to_dict()
    (out / "summary.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tests = tables.per_test_table(summary.tests, rows.table())
    tables.write_tests_csv(out / "tests.csv", tests)
    (out / "report.md").write_text(render_markdown(summary, tests), encoding="utf-8")
    page = render_html(summary, grid, run_ids, history, tests)
    (out / "report.html").write_text(page, encoding="utf-8")
    return tests
