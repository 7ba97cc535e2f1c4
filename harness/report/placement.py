"""Failures by GPU: a test that fails on one device and passes on others is a placement finding.

With `--gpus` every row names the device its process was pinned to. A test whose
failures all happened on one GPU while it passed on at least one other is not (only)
a bug in the test: the device is suspect (ECC errors, clocks, a MIG slice, a different
model) or the test assumes something about device ordinals. `placement_section` finds
them and counts attempts and failures per GPU for summary.json's `placement`;
`markdown`, `html_section` and `console_line` render it. Unpinned sweeps have none.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from typing import Any

from ..verdicts.fold import Attempt


def placement_section(attempts: Iterable[Attempt]) -> dict[str, Any] | None:
    """{"gpus": {gpu: {attempts, failures}}, "findings": [...]}; None when no attempt ran
    pinned to one GPU."""
    pinned = [a for a in attempts if a.gpu]
    if not pinned:
        return None
    per_gpu: dict[str, dict[str, int]] = {}
    per_test: dict[str, dict[str, list[int]]] = {}  # nodeid -> gpu -> [attempts, failures]
    for attempt in pinned:
        failed, gpu = attempt.failed, attempt.gpu
        counts = per_gpu.setdefault(gpu, {"attempts": 0, "failures": 0})
        counts["attempts"] += 1
        counts["failures"] += failed
        tally = per_test.setdefault(attempt.nodeid, {}).setdefault(gpu, [0, 0])
        tally[0] += 1
        tally[1] += failed
    findings = []
    for nodeid, by_gpu in sorted(per_test.items()):
        failing = [g for g, (_, failures) in by_gpu.items() if failures]
        passing = sorted(g for g, (attempts, failures) in by_gpu.items() if attempts > failures)
        elsewhere = [g for g in passing if g not in failing]
        if len(failing) == 1 and elsewhere:
            gpu = failing[0]
            findings.append({"nodeid": nodeid, "gpu": gpu, "failures": by_gpu[gpu][1],
                             "attempts": by_gpu[gpu][0], "passed_on": elsewhere})  # fmt: skip
    return {"gpus": dict(sorted(per_gpu.items())), "findings": findings}


def _finding_text(f: Mapping[str, Any]) -> str:
    return (f"failed only on GPU {f['gpu']} ({f['failures']} of {f['attempts']} attempts there), "
            f"passed on GPU {', '.join(f['passed_on'])}")  # fmt: skip


WHY = ("a hardware or placement finding: check that device (ECC errors, clocks, MIG, model) "
       "or what the test assumes about device ordinals")  # fmt: skip


def markdown(section: Mapping[str, Any] | None) -> list[str]:
    if not section:
        return []
    lines = ["## Failures by GPU", "", "| GPU | attempts | failed |", "|---|---|---|"]
    lines += [f"| {g} | {c['attempts']} | {c['failures']} |" for g, c in section["gpus"].items()]
    lines.append("")
    if section["findings"]:
        lines += [f"Tests failing on one GPU only ({WHY}):", ""]
        lines += [f"- `{f['nodeid']}` {_finding_text(f)}" for f in section["findings"]]
        lines.append("")
    return lines


def html_section(section: Mapping[str, Any] | None) -> str:
    if not section:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(g)}</td><td>{c['attempts']}</td><td>{c['failures']}</td></tr>"
        for g, c in section["gpus"].items()
    )
    found = "".join(
        f"<li><code>{html.escape(f['nodeid'])}</code> {html.escape(_finding_text(f))}</li>"
        for f in section["findings"]
    )
    findings = f"<p>Tests failing on one GPU only ({html.escape(WHY)}):</p><ul>{found}</ul>"
    return (
        "<section><h2>Failures by GPU</h2><table><thead><tr><th>GPU</th><th>attempts</th>"
        f"<th>failed</th></tr></thead><tbody>{rows}</tbody></table>"
        f"{findings if found else ''}</section>"
    )


def console_line(section: Mapping[str, Any] | None) -> str | None:
    """One line for the end of the console when some test failed on one GPU only
    (`section`: the summary's `placement`)."""
    findings = section["findings"] if section else []
    if not findings:
        return None
    gpus = sorted({f["gpu"] for f in findings})
    return (f"  placement: {len(findings)} test(s) failed on one GPU only (GPU "
            f"{', '.join(gpus)}) and passed on others: {WHY}")  # fmt: skip
