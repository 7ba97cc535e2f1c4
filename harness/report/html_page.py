"""report.html: one self-contained page (inline CSS and SVG, no script, no CDN).

It opens from a CI artifact or a mail attachment with no network, and leads with what
needs a person: the verdict, then the tests worst first with their flake rate and 95 %
interval, the cause found for each, its failure message (first lines, the whole output
in a fold) and the command that replays it, the run-by-test heat map, the tests that were
skipped, xfailed or xpassed, the environment variables tests left changed, the polluter ->
victim pairs, the searches and the trend across sweeps.

The page is the Jinja2 template templates/report.html.j2 (shipped as package data, with
autoescape on); this module computes what it shows: every value and the geometry of the
SVG bars and sparklines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup, escape

from ..verdicts.catalogue import BY_NAME, CLASSES, Verdict, colour
from . import gpu_report, placement, tables
from .shared import (
    CELL_LABELS,
    OUTCOME_COLOURS,
    Cell,
    class_counts,
    cleaners_of,
    evidence_lines,
    fix_of,
    leaky_tests,
    other_outcomes,
    outcome_counts,
    pairs,
    pct,
    per_test,
    search_bound,
    shard_line,
    verdict_line,
)
from .summary import SearchRecord, Summary

HEATMAP_LIMIT = 80  # rows of the heat map; the rest are summarised in one line
PASSING_SHOWN = 200  # passing tests listed in the collapsed section of the table
TEMPLATES = Path(__file__).with_name("templates")


def render_html(
    summary: Summary,
    grid: Mapping[str, Sequence[str]],
    run_ids: Sequence[str],
    history: Sequence[Mapping[str, str]],
    tests: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The whole report page as one string (`tests`: the per-test table)."""
    tests = per_test(summary, tests)
    bad = [t for t in tests if t["classification"] != Verdict.PASS]
    good = [t for t in tests if t["classification"] == Verdict.PASS]
    series = tables.trends(history)
    seeds = ", ".join(str(s) for s in summary.seeds) or "none"
    counts = class_counts(summary)  # pass without the skipped and xfailed
    classes = [
        {"name": c, "n": counts[c], "colour": colour(c), "description": BY_NAME[c].description}
        for c in CLASSES
    ]
    context = {
        "meta": {
            "runs": summary.runs, "workers": summary.workers, "backend": summary.backend,
            "duration": f"{summary.duration_s:.1f}", "seeds": seeds, "timeout": summary.timeout,
        },
        "tone": _tone(summary, bad),
        "verdict": verdict_line(summary, len(tests), len(bad)),
        "trend": _sweep_trend(history),
        "cards": [c for c in classes if c["n"]],  # a class none of the tests is in: one line
        "zero_classes": [c for c in classes if not c["n"]],
        "outcome_line": outcome_counts(tests),
        "notes": ([shard_line(summary.shard)] if summary.shard else []) + list(summary.notes),
        "gpu_section": Markup(gpu_report.html_section(summary.gpu)),  # escaped there
        "placement_section": Markup(placement.html_section(summary.placement)),
        "bad": [_row(t, series.get(t["nodeid"], [])) for t in bad],
        "good": [_row(t, series.get(t["nodeid"], [])) for t in good[:PASSING_SHOWN]],
        "good_count": len(good),
        "good_more": len(good) - PASSING_SHOWN,
        "heat": _heatmap(tests, grid, run_ids),
        "others": [_other(t) for t in other_outcomes(tests)],
        "leaks": [
            {"nodeid": t["nodeid"], "cls": t["classification"],
             "colour": colour(t["classification"]), "variable": variable, "before": before,
             "after": after}
            for t in leaky_tests(tests)
            for variable, before, after in t["env_leaks"]
        ],
        "pairs": [
            {"causes": causes, "test": test, "verb": "breaks" if kind == "polluter" else "sets up",
             "colour": colour(Verdict.ORDER_DEPENDENT if kind == "polluter" else Verdict.BRITTLE)}
            for kind, causes, test in pairs(tests)
        ],
        "searches": [_search(s) for s in summary.searches],
        "fixes": summary.fixes,
        "fixes_line": f"{sum(f.patched for f in summary.fixes)} of {len(summary.fixes)} "
        "verdicts got a verified patch; `capsafe fix OUT` applies them all.",
    }  # fmt: skip
    return _template().render(context)


def _tone(summary: Summary, bad: Sequence[Mapping[str, Any]]) -> str:
    """The headline's colour: a partial (interrupted) report is never green."""
    if bad or summary.suite_errors:
        return "bad"
    return "partial" if summary.interrupted else "ok"


@cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a name the page uses and nobody gave is a bug
        keep_trailing_newline=True,
    )
    env.filters["breakable"] = breakable
    return env.get_template("report.html.j2")


def breakable(nodeid: str) -> Markup:
    """`nodeid` escaped, with line-break points after each `/` and `::` only: a long id
    wraps between its path, class and test names, never inside a name."""
    out = Markup("")
    for part in re.split(r"(/|::)", nodeid):
        out += escape(part)
        if part in ("/", "::"):
            out += Markup("<wbr>")
    return out


def _sweep_trend(history: Sequence[Mapping[str, str]]) -> dict[str, Any] | None:
    counts = tables.not_passing_per_sweep(history)
    if len(counts) < 2:
        return None
    top = max(counts) or 1
    return {"sweeps": len(counts), "spark": _sparkline([c / top for c in counts], 160, 28)}


def _row(t: Mapping[str, Any], rates: list[float]) -> dict[str, Any]:
    lo, hi = t["flake_rate_ci"]
    cls = t["classification"]
    outcome = t.get("outcome", "")
    return {
        "nodeid": t["nodeid"],
        "message": _message(t),
        "leaks": t.get("env_leaks", []),
        "replay": t["replay"],
        "cls": cls,
        "colour": colour(cls),
        "outcome": outcome if outcome in OUTCOME_COLOURS else "",
        "outcome_colour": OUTCOME_COLOURS.get(outcome, ""),
        "bar": _rate_bar(t["flake_rate"], lo, hi),
        "failures": t["failures"],
        "runs": t["runs"],
        "rate": pct(t["flake_rate"]),
        "lo": pct(lo),
        "hi": pct(hi),
        "alone": (
            f"{t['isolation_failures']}/{t['isolation_runs']} failed"
            if t["isolation_runs"]
            else "—"
        ),
        "cause": _cause(t),
        "why": [line for line in evidence_lines(t) if line] if cls != Verdict.PASS else [],
        "signals": t["signals"],
        "trend": _sparkline(rates) if len(rates) > 1 else None,
        "cleaners": cleaners_of(t),
        "fix": _fix(t),
    }


def _fix(t: Mapping[str, Any]) -> dict[str, Any] | None:
    """A verified patch's summary line, its diff line by line (coloured), and its command."""
    fix = fix_of(t)
    if fix is None:
        return None
    kinds = (("+++", "file"), ("---", "file"), ("+", "add"), ("-", "del"), ("@@", "hunk"))
    lines = [
        {"text": line, "kind": next((k for mark, k in kinds if line.startswith(mark)), "")}
        for line in str(fix["diff"]).splitlines()
    ]
    return {**fix, "lines": lines}


def _cause(t: Mapping[str, Any]) -> tuple[str, list[str]] | None:
    """(how the tests named relate to this one, the tests), the first kind found."""
    for key, label in (
        ("polluters", "after"),
        ("state_setters", "passes after"),
        ("collides_with", "collides with"),
        ("concurrent", "beside"),
        ("unconfirmed", "unconfirmed"),
    ):
        if t.get(key):
            return label, list(t[key])
    return None


def _message(t: Mapping[str, Any]) -> dict[str, str] | None:
    """The first lines of a non-pass test's failure, the whole output in a fold."""
    message, details = t.get("message", ""), t.get("details", "")
    if not message or (t["classification"] == Verdict.PASS and t.get("outcome") == "passed"):
        return None
    fold = details if details and details.strip() != message.strip() else ""
    # a skip or xfail reason of a test that never failed: not a red failure box
    kind = "msg reason" if t["classification"] == Verdict.PASS else "msg"
    return {"kind": kind, "text": message, "details": fold}


def _other(t: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "nodeid": t["nodeid"],
        "outcome": t["outcome"],
        "outcome_colour": OUTCOME_COLOURS[t["outcome"]],
        "attempts": ", ".join(f"{o} {n}" for o, n in t.get("outcomes", {}).items()),
        "message": _message(t),
    }


def _search(s: SearchRecord) -> dict[str, Any]:
    bound = search_bound(s.candidates)
    return {"victim": s.victim, "candidates": s.candidates, "replays": s.replays,
            "bound": bound, "within": s.replays <= bound}  # fmt: skip


def _rate_bar(rate: float, lo: float, hi: float, width: int = 110) -> dict[str, Any]:
    """The flake rate as a bar, its 95% interval as a whisker over it."""

    def x(value: float) -> float:
        return 1 + value * (width - 2)

    return {
        "width": width,
        "track": width - 2,
        "fill": f"{max(0.0, x(rate) - 1):.1f}",
        "colour": _rate_colour(rate),
        "lo": f"{x(lo):.1f}",
        "hi": f"{x(hi):.1f}",
    }


def _rate_colour(rate: float) -> str:
    if rate == 0:
        return colour(Verdict.PASS)
    return colour(Verdict.FAIL) if rate >= 0.5 else colour(Verdict.FLAKY)


def _sparkline(values: Sequence[float], width: int = 84, height: int = 20) -> dict[str, Any]:
    """An inline SVG line of values in [0, 1], oldest left, the latest marked."""
    step = (width - 6) / max(1, len(values) - 1)
    points = [(3 + i * step, height - 3 - v * (height - 6)) for i, v in enumerate(values)]
    lx, ly = points[-1]
    return {
        "width": width,
        "height": height,
        "points": " ".join(f"{x:.1f},{y:.1f}" for x, y in points),
        "x": f"{lx:.1f}",
        "y": f"{ly:.1f}",
        "dot": _rate_colour(values[-1]),
    }


def _heatmap(
    tests: Sequence[Mapping[str, Any]], grid: Mapping[str, Sequence[str]], run_ids: Sequence[str]
) -> dict[str, Any] | None:
    if not run_ids:
        return None
    failing = [
        t
        for t in tests
        if any(s not in (Cell.PASSED, Cell.NOT_RUN) for s in grid.get(t["nodeid"], ()))
    ]
    cols = len(run_ids)
    rows = []
    for t in failing[:HEATMAP_LIMIT]:
        states = list(grid.get(t["nodeid"], ())) + [Cell.NOT_RUN] * cols
        rows.append({"nodeid": t["nodeid"], "colour": colour(t["classification"]),
                     "cells": list(zip(run_ids, states[:cols], strict=True))})  # fmt: skip
    return {
        "intro": f"{len(failing)} of {len(tests)} tests failed in at least one run; "
        "every other test passed in every run it was in.",
        "run_ids": list(run_ids),
        "rows": rows,
        "more": len(failing) - HEATMAP_LIMIT,
        "legend": list(CELL_LABELS.items()),
    }
