"""The report's GPU section: capture safety, frozen configuration, leaked CUDA settings.

`gpu_section` gathers, from the sweep's verdicts and rows, what a GPU engineer
reads first: the neighbour threads (or why they could not start) with their own
driver errors per call kind, each capture-unsafe test with the call kinds that
break it, what that says about its capture mode and how to fix it, whether it
survived its reruns with `--capsafe-protect` (harness.sweep.capture_sweep), and the replay
line reproducing it; frozen-config violations with each variable's frozen and
current value; `CUDA_*`/`CAPSAFE_*` variables tests left changed.
`markdown` and `html` render it for report.md and report.html.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..records import Signal
from ..verdicts.catalogue import Verdict

ENV_PREFIXES = ("CUDA_", "CAPSAFE_")
#: One changed variable in a FrozenConfigError message (capsafe.config.Change.describe).
_CHANGE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*): frozen (.+?), now (.+?)\s*$", re.MULTILINE)


def gpu_section(
    tests: Sequence[Mapping[str, Any]],
    rows: Iterable[Mapping[str, Any]],
    neighbors: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """summary.json's `gpu` object (see the module doc)."""
    frozen: dict[str, dict[str, list[str]]] = {}
    leaks: dict[tuple[str, str], list[str | None]] = {}
    for row in rows:
        if Signal.FROZEN_CONFIG in row.get("signals", ()):
            text = f"{row.get('message', '')}\n{row.get('details', '')}"
            for var, was, now in _CHANGE.findall(text):
                frozen.setdefault(row["nodeid"], {})[var] = [was, now]
        for var, values in (row.get("env_leak") or {}).items():
            if var.startswith(ENV_PREFIXES):
                leaks.setdefault((row["nodeid"], var), list(values))
    return {
        "neighbors": dict(neighbors or {}),
        "capture_unsafe": [
            {"nodeid": t["nodeid"], **t["capture"]}
            for t in tests
            if t["classification"] == Verdict.CAPTURE_UNSAFE and t.get("capture")
        ],
        "frozen_config": [
            {"nodeid": n, "changes": [_change(v, a, b) for v, (a, b) in sorted(c.items())]}
            for n, c in sorted(frozen.items())
        ],
        "env_leaks": [
            {"nodeid": n, "variable": v, "before": a, "after": b}
            for (n, v), (a, b) in sorted(leaks.items())
        ],
    }


def _sentence(text: str) -> str:
    return f"{text[0].upper()}{text[1:]}."


def _change(variable: str, frozen: str, now: str) -> dict[str, str]:
    return {"variable": variable, "frozen": frozen, "now": now}


def _has_content(gpu: Mapping[str, Any]) -> bool:
    n = gpu.get("neighbors") or {}
    return bool(
        n.get("processes") or n.get("unavailable") or gpu.get("capture_unsafe")
        or gpu.get("frozen_config") or gpu.get("env_leaks")
    )  # fmt: skip


def _neighbor_lines(n: Mapping[str, Any]) -> list[str]:
    if n.get("unavailable"):
        return [f"Neighbour threads could not start: {'; '.join(n['unavailable'])}. "
                "No capture-safety verdicts."]  # fmt: skip
    if not n.get("processes"):
        return ["No neighbour threads (run with --neighbors K for capture-safety verdicts)."]
    errors = n.get("driver_errors") or {}
    calls = sum((n.get("calls") or {}).values())
    lines = [
        f"Neighbour threads in {n['processes']} processes ({', '.join(n.get('backend', []))}): "
        f"{calls} calls; their own driver errors: "
        + (", ".join(f"{k} {v}" for k, v in errors.items()) or "none")
    ]
    lines += [f"Neighbour thread problem: {p}" for p in n.get("problems", [])]
    return lines


def markdown(gpu: Mapping[str, Any] | None) -> list[str]:
    """report.md lines of the GPU section (none when there is nothing GPU-related)."""
    if not gpu or not _has_content(gpu):
        return []
    lines = ["## GPU", "", *_neighbor_lines(gpu.get("neighbors") or {}), ""]
    for t in gpu.get("capture_unsafe", []):
        lines += [
            f"- `{t['nodeid']}` is capture-unsafe: {t['verdict']}.",
            f"  {t['advice'][0].upper()}{t['advice'][1:]}.",
            *([f"  {_sentence(t['protection'])}"] if t.get("protection") else []),
            "",
            "  ```sh",
            f"  {t['replay']}",
            "  ```",
            "",
        ]
    for t in gpu.get("frozen_config", []):
        changes = "; ".join(f"{c['variable']}: frozen {c['frozen']}, now {c['now']}"
                            for c in t["changes"])  # fmt: skip
        lines.append(f"- `{t['nodeid']}` changed frozen configuration: {changes}")
    for t in gpu.get("env_leaks", []):
        lines.append(
            f"- `{t['nodeid']}` left {t['variable']} changed: {t['before']!r} -> {t['after']!r}"
        )
    return [*lines, ""]


def html_section(gpu: Mapping[str, Any] | None) -> str:
    """report.html's GPU section ("" when there is nothing GPU-related)."""
    if not gpu or not _has_content(gpu):
        return ""
    e = html.escape
    parts = ["<h2>GPU</h2>"]
    parts += [f'<p class="note">{e(line)}</p>' for line in _neighbor_lines(gpu["neighbors"])]
    for t in gpu.get("capture_unsafe", []):
        protection = t.get("protection")
        parts.append(
            f'<div class="gpu-test"><p><code>{e(t["nodeid"])}</code> is '
            f"<b>capture-unsafe</b>: {e(t['verdict'])}.</p><p>{e(t['advice'])}.</p>"
            f"{f'<p>{e(_sentence(protection))}</p>' if protection else ''}"
            f"<pre>{e(t['replay'])}</pre></div>"
        )
    rows = [
        (t["nodeid"], f"frozen config: {c['variable']} frozen {c['frozen']}, now {c['now']}")
        for t in gpu.get("frozen_config", [])
        for c in t["changes"]
    ] + [
        (t["nodeid"], f"env leak: {t['variable']} {t['before']!r} -> {t['after']!r}")
        for t in gpu.get("env_leaks", [])
    ]
    if rows:
        parts.append("<table><tr><th>test</th><th>finding</th></tr>")
        parts += [f"<tr><td><code>{e(n)}</code></td><td>{e(f)}</td></tr>" for n, f in rows]
        parts.append("</table>")
    return "\n".join(parts)
