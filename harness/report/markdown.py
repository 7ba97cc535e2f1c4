"""report.md: a plain-text report for terminals, PR comments and chat."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..verdicts.catalogue import CLASSES, Verdict
from . import gpu_report, placement, tables
from .shared import (
    class_counts,
    cleaners_of,
    evidence_lines,
    fix_of,
    leaky_tests,
    other_outcomes,
    outcome_counts,
    pct,
    per_test,
    search_bound,
    shard_line,
    verdict_line,
)
from .summary import Summary


def render_markdown(summary: Summary, tests: Sequence[Mapping[str, Any]] | None = None) -> str:
    """A plain-text report for terminals, PR comments and chat (`tests`: the per-test table)."""
    tests = per_test(summary, tests)
    bad = [t for t in tests if t["classification"] != Verdict.PASS]
    counts = class_counts(summary)  # pass without the skipped and xfailed
    lines = [
        "# capsafe sweep",
        "",
        f"{verdict_line(summary, len(tests), len(bad))}",
        "",
        "| " + " | ".join(CLASSES) + " |",
        "|" + "---|" * len(CLASSES),
        "| " + " | ".join(str(counts.get(c, 0)) for c in CLASSES) + " |",
        "",
    ]
    if outcomes := outcome_counts(tests):
        lines += [f"Outcomes of the tests classed pass: {outcomes}", ""]
    lines += [
        f"Runs: {summary.runs} · workers: {summary.workers} · backend: "
        f"{summary.backend} · {summary.duration_s:.1f} s · seeds: "
        + ", ".join(str(s) for s in summary.seeds),
        "",
    ]
    if summary.timeout:
        lines += [f"Per-test timeout: {summary.timeout}", ""]
    if summary.shard:
        lines += [f"> **{shard_line(summary.shard)}**", ""]
    for note in summary.notes:  # a blank line apart: one quote block each
        lines += [f"> **Note:** {note}", ""]
    lines += gpu_report.markdown(summary.gpu)
    lines += placement.markdown(summary.placement)
    if bad:
        lines += [
            "## Tests that need attention",
            "",
            "| test | class | failed in runs | flake rate (95% CI) | alone | cause | signals |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in bad:
            lo, hi = t["flake_rate_ci"]
            cause = _cause_text(t)
            lines.append(
                f"| `{_md(t['nodeid'])}` | {t['classification']} | {t['failures']}/{t['runs']} "
                f"| {pct(t['flake_rate'])} ({pct(lo)}–{pct(hi)}) "
                f"| {t['isolation_failures']}/{t['isolation_runs']} failed "
                f"| {_md(cause)} | {', '.join(t['signals'])} |"
            )
        lines += ["", "## Failures", ""]
        for t in bad:
            lines += [f"### `{t['nodeid']}` ({t['classification']})", ""]
            lines += evidence_lines(t)
            lines += _md_message(t)
            lines += [
                f"- env: {_md(tables.env_leak_text(leak))}" for leak in t.get("env_leaks", [])
            ]
            lines += ["", "Reproduce:", "", "```sh", t["replay"], "```", ""]
            lines += _fix_lines(t)
    others = other_outcomes(tests)
    if others:
        lines += ["## Skipped, xfailed and xpassed", "",
                  "Not counted as pass; never failed, so not a failure either.", "",
                  "| test | outcome | attempts | reason |", "|---|---|---|---|"]  # fmt: skip
        for t in others:
            attempts = ", ".join(f"{o} {n}" for o, n in t.get("outcomes", {}).items())
            reason = " ".join(t.get("message", "").split())
            lines.append(f"| `{_md(t['nodeid'])}` | {t['outcome']} | {attempts} | {_md(reason)} |")
        lines.append("")
    leaky = leaky_tests(tests)
    if leaky:
        lines += ["## Environment left changed", "", "| test | class | variable | before | after |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for t in leaky:
            for variable, before, after in t["env_leaks"]:
                lines.append(
                    f"| `{_md(t['nodeid'])}` | {t['classification']} | `{_md(variable)}` "
                    f"| {_md(_value(before))} | {_md(_value(after))} |"
                )
        lines.append("")
    lines += _fixes_section(summary)
    if summary.searches:
        lines += ["## Searches", "", "| test | candidates | replays | bound |", "|---|---|---|---|"]
        for s in summary.searches:
            lines.append(
                f"| `{_md(s.victim)}` | {s.candidates} | {s.replays} "
                f"| {search_bound(s.candidates)} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def _fix_lines(test: Mapping[str, Any]) -> list[str]:
    """A test's cleaners and its verified patch: the diff and the command that applies it."""
    lines = []
    if cleaners := cleaners_of(test):
        named = ", ".join(f"`{c}`" for c in cleaners)
        lines += [f"Cleaners (run between its polluter and it, it passes): {named}", ""]
    fix = fix_of(test)
    if fix is None:
        return lines
    return [*lines, f"Verified fix ({fix['source']}, `{fix['path']}`): {fix['how']}", "",
            *_fenced(str(fix["diff"]), "diff"), "", "Apply it:", "", "```sh",
            str(fix["apply"]), "```", ""]  # fmt: skip


def _fixes_section(summary: Summary) -> list[str]:
    """The fixing phase (--fix): each verdict it worked on, its cleaners and its patch."""
    if not summary.fixes:
        return []
    patched = sum(f.patched for f in summary.fixes)
    lines = ["## Fixes", "", f"{patched} of {len(summary.fixes)} verdicts got a verified patch "
             "(`capsafe fix OUT` applies them all).", "",
             "| test | class | cleaners | cleaner replays | patch |",
             "|---|---|---|---|---|"]  # fmt: skip
    for f in summary.fixes:
        cleaners = ", ".join(f"`{_md(c)}`" for c in f.cleaners) or "—"
        patch = ("verified: " if f.patched else "none: ") + f.outcome
        lines.append(f"| `{_md(f.victim)}` | {f.kind} | {cleaners} | {f.cleaner_replays} "
                     f"| {_md(patch)} |")  # fmt: skip
    return [*lines, ""]


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _md_message(test: Mapping[str, Any]) -> list[str]:
    """The failure's first lines in a code block, the whole output folded below it."""
    message, details = test.get("message", ""), test.get("details", "")
    if not message:
        return ["(no failure message recorded)", ""]
    lines = [*_fenced(message), ""]
    if details and details.strip() != message.strip():
        lines += ["<details><summary>full output</summary>", "", *_fenced(details), "",
                  "</details>", ""]  # fmt: skip
    return lines


def _fenced(text: str, language: str = "text") -> list[str]:
    """`text` in a code fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + language, text.rstrip("\n"), fence]


def _value(value: str | None) -> str:
    return "unset" if value is None else f"`{value}`"


def _cause_text(test: Mapping[str, Any]) -> str:
    if test["polluters"]:
        return "after " + " + ".join(test["polluters"])
    if test["state_setters"]:
        return "passes after " + " + ".join(test["state_setters"])
    if test.get("collides_with"):
        return "collides with " + ", ".join(test["collides_with"])
    if test.get("concurrent"):
        return "beside " + ", ".join(test["concurrent"])
    if test.get("unconfirmed"):
        return "unconfirmed: " + " + ".join(test["unconfirmed"])
    capture = test.get("capture")
    return str(capture.get("protection", "")) if isinstance(capture, dict) else ""
