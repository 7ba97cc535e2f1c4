"""report.html: one self-contained page (inline CSS and SVG, no script, no CDN).

It opens from a CI artifact or a mail attachment with no network, and leads with what
needs a person: the verdict, then the tests worst first with their flake rate and 95 %
interval, the cause found for each and its failure message (first lines, the whole
output in a fold), the run-by-test heat map, the tests that were skipped, xfailed or
xpassed, the environment variables tests left changed, the polluter -> victim pairs,
the searches and the trend across sweeps.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from ..verdicts.catalogue import BY_NAME, CLASSES, Verdict, colour
from . import gpu_report, placement, tables
from .shared import (
    CELL_LABELS,
    OUTCOME_COLOURS,
    Cell,
    class_counts,
    evidence_lines,
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
    series = tables.trends(history)
    body = [
        _header(summary, tests, len(bad), history),
        _notes([shard_line(summary.shard)] if summary.shard else []),
        _notes(summary.notes),
        gpu_report.html_section(summary.gpu),
        placement.html_section(summary.placement),
        _table(tests, series),
        _heatmap(tests, grid, run_ids),
        _other_outcomes_section(tests),
        _leaks_section(tests),
        _pairs(tests),
        _searches(summary.searches),
        _FOOTER,
    ]
    return _PAGE.format(css=_CSS, body="\n".join(part for part in body if part))


def _header(
    summary: Summary,
    tests: Sequence[Mapping[str, Any]],
    bad: int,
    history: Sequence[Mapping[str, str]],
) -> str:
    total = len(tests)
    tone = "ok" if bad == 0 and not summary.suite_errors else "bad"
    if summary.interrupted and tone == "ok":  # a partial report is never green
        tone = "partial"
    counts = class_counts(summary)  # pass without the skipped and xfailed
    cards = "".join(
        f'<div class="card" style="--c:{colour(c)}"><div class="n">{counts[c]}'
        f'</div><div class="k">{c}</div><div class="d">{BY_NAME[c].description}</div></div>'
        for c in CLASSES
    )
    seeds = ", ".join(str(s) for s in summary.seeds) or "none"
    meta = (
        f"<span>{summary.runs} runs</span><span>{summary.workers} workers</span>"
        f"<span>backend <b>{_e(summary.backend)}</b></span>"
        f"<span>{summary.duration_s:.1f} s</span>"
        f'<span title="seeds of the runs">seeds {_e(seeds)}</span>'
        + (f"<span>timeout {_e(summary.timeout)}</span>" if summary.timeout else "")
    )
    trend = _sweep_trend(history)
    outcomes = outcome_counts(tests)
    outcome_line = (
        f'<p class="muted">Outcomes of the tests classed pass: {_e(outcomes)}</p>'
        if outcomes
        else ""
    )
    return (
        f'<header><h1>capsafe sweep</h1><div class="meta">{meta}</div>'
        f'<div class="verdict {tone}">{_e(verdict_line(summary, total, bad))}{trend}</div>'
        f'<div class="cards">{cards}</div>{outcome_line}</header>'
    )


def _sweep_trend(history: Sequence[Mapping[str, str]]) -> str:
    counts = tables.not_passing_per_sweep(history)
    if len(counts) < 2:
        return ""
    top = max(counts) or 1
    spark = _sparkline([c / top for c in counts], width=160, height=28)
    return (
        f'<span class="trend" title="tests not passing, last {len(counts)} sweeps">'
        f"{spark}<small>not passing, last {len(counts)} sweeps</small></span>"
    )


def _notes(notes: Sequence[str]) -> str:
    return "".join(f'<div class="note">{_e(n)}</div>' for n in notes)


def _table(tests: Sequence[Mapping[str, Any]], series: Mapping[str, list[float]]) -> str:
    bad = [t for t in tests if t["classification"] != Verdict.PASS]
    good = [t for t in tests if t["classification"] == Verdict.PASS]
    head = (
        "<tr><th>test</th><th>class</th><th>flake rate · 95% CI</th><th>alone</th>"
        "<th>cause</th><th>signals</th><th>trend</th></tr>"
    )
    rows = "".join(_row(t, series.get(t["nodeid"], [])) for t in bad)
    section = "<section><h2>Tests, worst first</h2>"
    if bad:
        section += f'<table class="tests"><thead>{head}</thead><tbody>{rows}</tbody></table>'
    if good:
        shown = "".join(_row(t, series.get(t["nodeid"], [])) for t in good[:PASSING_SHOWN])
        more = len(good) - PASSING_SHOWN
        tail = f'<p class="muted">… and {more} more, all in tests.csv</p>' if more > 0 else ""
        section += (
            f"<details><summary>{len(good)} passing tests</summary>"
            f'<table class="tests"><thead>{head}</thead><tbody>{shown}</tbody></table>'
            f"{tail}</details>"
        )
    return section + "</section>"


def _row(t: Mapping[str, Any], rates: list[float]) -> str:
    lo, hi = t["flake_rate_ci"]
    cls = t["classification"]
    alone = (
        f"{t['isolation_failures']}/{t['isolation_runs']} failed" if t["isolation_runs"] else "—"
    )
    cause = ""
    if t["polluters"]:
        cause = '<span class="muted">after</span> ' + " ".join(
            f"<code>{_e(p)}</code>" for p in t["polluters"]
        )
    elif t["state_setters"]:
        cause = '<span class="muted">passes after</span> ' + " ".join(
            f"<code>{_e(s)}</code>" for s in t["state_setters"]
        )
    elif t.get("collides_with"):
        cause = '<span class="muted">collides with</span> ' + " ".join(
            f"<code>{_e(c)}</code>" for c in t["collides_with"]
        )
    elif t.get("concurrent"):
        cause = '<span class="muted">beside</span> ' + " ".join(
            f"<code>{_e(c)}</code>" for c in t["concurrent"]
        )
    elif t.get("unconfirmed"):
        cause = '<span class="muted">unconfirmed</span> ' + " ".join(
            f"<code>{_e(u)}</code>" for u in t["unconfirmed"]
        )
    if cls != Verdict.PASS:
        cause += "".join(f'<div class="why">{_e(line)}</div>' for line in evidence_lines(t) if line)
    signals = "".join(f'<span class="sig">{_e(s)}</span>' for s in t["signals"])
    leaks = "".join(_leak_line(leak) for leak in t.get("env_leaks", []))
    outcome = t.get("outcome", "")
    outcome_pill = (
        f' <span class="pill" style="--c:{OUTCOME_COLOURS[outcome]}">{outcome}</span>'
        if outcome in OUTCOME_COLOURS
        else ""
    )
    replay = (
        f"<details class='replay'><summary>replay</summary><code>{_e(t['replay'])}</code></details>"
        if t["replay"]
        else ""
    )
    return (
        f'<tr><td class="id"><code>{_e(t["nodeid"])}</code>{_html_message(t)}{leaks}{replay}</td>'
        f'<td><span class="pill" style="--c:{colour(cls)}">{cls}</span>{outcome_pill}</td>'
        f'<td class="rate">{_rate_bar(t["flake_rate"], lo, hi)}'
        f"<span>{t['failures']}/{t['runs']} · {pct(t['flake_rate'])} "
        f'<span class="muted">[{pct(lo)}–{pct(hi)}]</span></span></td>'
        f'<td class="nw">{alone}</td><td class="cause">{cause}</td><td>{signals}</td>'
        f"<td>{_sparkline(rates) if len(rates) > 1 else ''}</td></tr>"
    )


def _html_message(t: Mapping[str, Any]) -> str:
    """The first lines of a non-pass test's failure, the whole output in a fold."""
    message, details = t.get("message", ""), t.get("details", "")
    if not message or (t["classification"] == Verdict.PASS and t.get("outcome") == "passed"):
        return ""
    fold = (
        f'<details class="full"><summary>full output</summary><pre>{_e(details)}</pre></details>'
        if details and details.strip() != message.strip()
        else ""
    )
    # a skip or xfail reason of a test that never failed: not a red failure box
    kind = "msg reason" if t["classification"] == Verdict.PASS else "msg"
    return f'<pre class="{kind}">{_e(message)}</pre>{fold}'


def _leak_line(leak: Sequence[str | None]) -> str:
    variable, before, after = leak
    return (
        f'<div class="leak">env <code>{_e(variable)}</code>: {_html_value(before)} → '
        f"{_html_value(after)}</div>"
    )


def _html_value(value: str | None) -> str:
    return '<span class="muted">unset</span>' if value is None else f"<code>{_e(value)}</code>"


def _other_outcomes_section(tests: Sequence[Mapping[str, Any]]) -> str:
    others = other_outcomes(tests)
    if not others:
        return ""
    rows = "".join(
        f'<tr><td class="id"><code>{_e(t["nodeid"])}</code></td>'
        f'<td><span class="pill" style="--c:{OUTCOME_COLOURS[t["outcome"]]}">{t["outcome"]}'
        f"</span></td><td>{_e(', '.join(f'{o} {n}' for o, n in t.get('outcomes', {}).items()))}"
        f"</td><td>{_html_message(t)}</td></tr>"
        for t in others
    )
    return (
        "<section><h2>Skipped, xfailed and xpassed</h2><p class='muted'>Not counted as pass, "
        "and never failed: shown with their own outcome and reason.</p>"
        '<table class="tests"><thead><tr><th>test</th><th>outcome</th><th>attempts</th>'
        f"<th>reason</th></tr></thead><tbody>{rows}</tbody></table></section>"
    )


def _leaks_section(tests: Sequence[Mapping[str, Any]]) -> str:
    leaky = leaky_tests(tests)
    if not leaky:
        return ""
    rows = "".join(
        f'<tr><td class="id"><code>{_e(t["nodeid"])}</code></td>'
        f'<td><span class="pill" style="--c:{colour(t["classification"])}">'
        f"{t['classification']}</span></td><td><code>{_e(variable)}</code></td>"
        f"<td>{_html_value(before)}</td><td>{_html_value(after)}</td></tr>"
        for t in leaky
        for variable, before, after in t["env_leaks"]
    )
    return (
        "<section><h2>Environment left changed</h2><p class='muted'>Watched variables a test "
        "changed and did not restore (passing tests included).</p>"
        '<table class="tests"><thead><tr><th>test</th><th>class</th><th>variable</th>'
        f"<th>before</th><th>after</th></tr></thead><tbody>{rows}</tbody></table></section>"
    )


def _rate_bar(rate: float, lo: float, hi: float, width: int = 110) -> str:
    """The flake rate as a bar, its 95% interval as a whisker over it."""

    def x(value: float) -> float:
        return 1 + value * (width - 2)

    return (
        f'<svg class="bar" width="{width}" height="14" viewBox="0 0 {width} 14" role="img">'
        f'<rect x="1" y="4" width="{width - 2}" height="6" rx="3" fill="#eaeef2"/>'
        f'<rect x="1" y="4" width="{max(0.0, x(rate) - 1):.1f}" height="6" rx="3" '
        f'fill="{_rate_colour(rate)}"/>'
        f'<line x1="{x(lo):.1f}" y1="7" x2="{x(hi):.1f}" y2="7" stroke="#24292f" '
        f'stroke-width="1.2"/>'
        f'<line x1="{x(lo):.1f}" y1="3" x2="{x(lo):.1f}" y2="11" stroke="#24292f"/>'
        f'<line x1="{x(hi):.1f}" y1="3" x2="{x(hi):.1f}" y2="11" stroke="#24292f"/></svg>'
    )


def _rate_colour(rate: float) -> str:
    if rate == 0:
        return colour(Verdict.PASS)
    return colour(Verdict.FAIL) if rate >= 0.5 else colour(Verdict.FLAKY)


def _sparkline(values: Sequence[float], width: int = 84, height: int = 20) -> str:
    """An inline SVG line of values in [0, 1], oldest left, the latest marked."""
    if not values:
        return ""
    step = (width - 6) / max(1, len(values) - 1)
    points = [(3 + i * step, height - 3 - v * (height - 6)) for i, v in enumerate(values)]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    lx, ly = points[-1]
    dot = _rate_colour(values[-1])
    return (
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
        f'<polyline points="{line}" fill="none" stroke="#57606a" stroke-width="1.4"/>'
        f'<circle cx="{lx:.1f}" cy="{ly:.1f}" r="2.6" fill="{dot}"/></svg>'
    )


def _heatmap(
    tests: Sequence[Mapping[str, Any]], grid: Mapping[str, Sequence[str]], run_ids: Sequence[str]
) -> str:
    failing = [
        t
        for t in tests
        if any(s not in (Cell.PASSED, Cell.NOT_RUN) for s in grid.get(t["nodeid"], ()))
    ]
    if not run_ids:
        return ""
    intro = (
        f"{len(failing)} of {len(tests)} tests failed in at least one run; "
        "every other test passed in every run it was in."
    )
    if not failing:
        return f'<section><h2>Failure heat map</h2><p class="muted">{intro}</p></section>'
    shown = failing[:HEATMAP_LIMIT]
    cols = len(run_ids)
    head = '<div class="hl"></div>' + "".join(
        f'<div class="hh" title="{_e(r)}">{i + 1}</div>' for i, r in enumerate(run_ids)
    )
    cells = []
    for t in shown:
        states = list(grid.get(t["nodeid"], ())) + [Cell.NOT_RUN] * cols
        cells.append(
            f'<div class="hl" title="{_e(t["nodeid"])}"><span class="dot" '
            f'style="--c:{colour(t["classification"])}"></span>{_e(t["nodeid"])}</div>'
        )
        cells += [
            f'<div class="hc {s}" title="{_e(t["nodeid"])} · {_e(r)}: {s}"></div>'
            for r, s in zip(run_ids, states[:cols], strict=True)
        ]
    more = (
        f'<p class="muted">… and {len(failing) - HEATMAP_LIMIT} more failing tests.</p>'
        if len(failing) > HEATMAP_LIMIT
        else ""
    )
    legend = "".join(
        f'<span><i class="hc {state}"></i>{label}</span>' for state, label in CELL_LABELS.items()
    )
    return (
        f'<section><h2>Failure heat map</h2><p class="muted">{intro} Columns are runs.</p>'
        f'<div class="heat" style="grid-template-columns:minmax(220px,max-content) '
        f'repeat({cols},22px)">{head}{"".join(cells)}</div>{more}'
        f'<div class="legend">{legend}</div></section>'
    )


def _pairs(tests: Sequence[Mapping[str, Any]]) -> str:
    found = pairs(tests)
    if not found:
        return ""
    items = []
    for kind, causes, test in found:
        hue = colour(Verdict.ORDER_DEPENDENT if kind == "polluter" else Verdict.BRITTLE)
        verb = "breaks" if kind == "polluter" else "sets up"
        cause = '<span class="plus">+</span>'.join(f"<code>{_e(c)}</code>" for c in causes)
        items.append(
            f'<div class="pair" style="--c:{hue}"><div class="who">{cause}</div>'
            f'<div class="arrow"><span>{verb}</span>→</div>'
            f'<div class="whom"><code>{_e(test)}</code></div></div>'
        )
    return f"<section><h2>Polluter → victim, state-setter → brittle</h2>{''.join(items)}</section>"


def _searches(searches: Sequence[SearchRecord]) -> str:
    if not searches:
        return ""
    rows = []
    for s in searches:
        bound = search_bound(s.candidates)
        within = s.replays <= bound
        rows.append(
            f"<tr><td><code>{_e(s.victim)}</code></td><td>{s.candidates}</td>"
            f"<td>{s.replays}</td><td>{bound}</td>"
            f'<td class="{"okc" if within else "badc"}">{"within" if within else "over"}</td></tr>'
        )
    return (
        "<section><h2>Searches</h2><p class='muted'>Replays each cause search took; "
        "a single culprit among n candidates should take at most ⌈log₂ n⌉ + 3.</p>"
        '<table class="tests"><thead><tr><th>test</th><th>candidates</th><th>replays</th>'
        f"<th>bound</th><th></th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


_FOOTER = (
    "<footer>Generated by <b>capsafe sweep</b>. Raw rows: records.jsonl · per test: "
    "tests.csv · machine-readable: summary.json · history: ../history.csv</footer>"
)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>capsafe sweep report</title><style>{css}</style></head>
<body><main>{body}</main></body></html>
"""

_CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--bg:#f6f8fa}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
 font:14px/1.45 -apple-system,BlinkMacSystemFont,"Segoe UI",Helvetica,Arial,sans-serif}
main{max-width:1320px;margin:0 auto;padding:28px 32px 48px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:17px;margin:0 0 12px}
section{background:#fff;border:1px solid var(--line);border-radius:10px;padding:18px 20px;
 margin:18px 0}
code{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;overflow-wrap:anywhere}
.muted{color:var(--muted)}
.meta{display:flex;flex-wrap:wrap;gap:6px 18px;color:var(--muted);margin-bottom:14px}
.verdict{display:flex;align-items:center;gap:24px;font-size:20px;font-weight:600;
 padding:14px 18px;border-radius:10px;margin-bottom:14px;border:1px solid}
.verdict.ok{background:#dafbe1;border-color:#aceebb;color:#116329}
.verdict.bad{background:#ffebe9;border-color:#ffcecb;color:#a40e26}
.verdict.partial{background:#fff8c5;border-color:#eac54f;color:#7d4e00}
.trend{display:flex;align-items:center;gap:8px;font-size:12px;font-weight:400;color:var(--muted)}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(130px,1fr));gap:12px}
.card{background:#fff;border:1px solid var(--line);border-top:4px solid var(--c);
 border-radius:10px;padding:12px 14px}
.card .n{font-size:28px;font-weight:700;color:var(--c)}
.card .k{font-weight:600}.card .d{color:var(--muted);font-size:12px}
.note{background:#fff8c5;border:1px solid #eac54f;border-radius:8px;padding:10px 14px;
 margin:10px 0}
table.tests{width:100%;border-collapse:collapse}
.tests th{text-align:left;font-size:12px;color:var(--muted);font-weight:600;
 border-bottom:1px solid var(--line);padding:6px 8px}
.tests td{border-bottom:1px solid #eaeef2;padding:8px;vertical-align:top}
.tests td.id{min-width:300px}.tests td.cause{min-width:190px}.tests td.nw{white-space:nowrap}
.pill{display:inline-block;padding:1px 9px;border-radius:999px;font-size:12px;font-weight:600;
 color:#fff;background:var(--c);white-space:nowrap}
.rate{white-space:nowrap}.rate svg{vertical-align:middle;margin-right:6px}
.sig{display:inline-block;font-size:11px;padding:0 7px;margin:0 4px 4px 0;border-radius:6px;
 background:#ddf4ff;color:#0969da;border:1px solid #b6e3ff;white-space:nowrap}
details.replay summary{font-size:12px;color:#0969da;cursor:pointer}
details.replay code{display:block;background:var(--bg);padding:6px 8px;border-radius:6px;
 margin-top:4px}
details>summary{cursor:pointer;color:var(--muted);margin-top:10px}
.heat{display:grid;gap:3px;align-items:center;overflow-x:auto}
.hh{font-size:11px;color:var(--muted);text-align:center}
.hl{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;white-space:nowrap;overflow:hidden;
 text-overflow:ellipsis;max-width:520px;padding-right:10px}
.dot{display:inline-block;width:8px;height:8px;border-radius:50%;background:var(--c);
 margin-right:6px}
.hc{height:18px;border-radius:4px;display:inline-block;width:18px}
.hc.passed{background:#aceebb}.hc.failed{background:#cf222e}.hc.timeout{background:#fb8f44}
.hc.crash{background:#24292f}
.hc.none{background:repeating-linear-gradient(45deg,#eaeef2 0 3px,#f6f8fa 3px 6px)}
.legend{display:flex;gap:16px;margin-top:12px;font-size:12px;color:var(--muted)}
.legend span{display:flex;align-items:center;gap:6px}.legend .hc{width:14px;height:14px}
.pair{display:grid;grid-template-columns:1fr 120px 1fr;align-items:center;gap:10px;
 padding:10px 12px;border-left:4px solid var(--c);background:var(--bg);border-radius:6px;
 margin:8px 0}
.arrow{text-align:center;font-size:22px;color:var(--c)}
.arrow span{display:block;font-size:11px;color:var(--muted)}
.plus{margin:0 6px;color:var(--muted)}
pre.msg{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;
 overflow-wrap:anywhere;background:#fff5f5;border-left:3px solid #cf222e;padding:6px 8px;
 margin:6px 0 0;max-width:760px}
pre.msg.reason{background:var(--bg);border-left-color:#6e7781}
details.full summary{font-size:12px;color:#0969da;cursor:pointer;margin-top:4px}
details.full pre{font:11px/1.35 ui-monospace,SFMono-Regular,Menlo,monospace;white-space:pre-wrap;
 overflow-wrap:anywhere;background:var(--bg);padding:6px 8px;border-radius:6px;max-height:480px;
 overflow:auto;max-width:760px}
.leak{font-size:12px;margin-top:4px}
.why{font-size:12px;color:var(--muted);margin-top:4px}
td.okc{color:#1a7f37;font-weight:600}td.badc{color:#cf222e;font-weight:600}
footer{color:var(--muted);font-size:12px;text-align:center;margin-top:24px}
"""
