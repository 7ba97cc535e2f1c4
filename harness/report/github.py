"""GitHub Actions output: an annotation per test that is not `pass`, and the job summary.

Written when GITHUB_ACTIONS is `true` (set by the Actions runner): one `::error` workflow
command per test found (`::warning` for one the --baseline quarantines) on stdout, at
the test's file and line, titled with its class, holding its cause and replay line, so
the verdict is on the pull request's page; and report.md appended to the file named
by GITHUB_STEP_SUMMARY (cut before its failure details where it would pass GitHub's
limit of 1 MiB per step). Workflow-command escaping as the runner reads it: `%`, CR
and LF in the message, and also `:` and `,` in a property.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..verdicts.catalogue import Verdict
from .shared import fix_line

ACTIONS_ENV = "GITHUB_ACTIONS"
SUMMARY_ENV = "GITHUB_STEP_SUMMARY"
WORKSPACE_ENV = "GITHUB_WORKSPACE"
SUMMARY_LIMIT = 1024 * 1024  # bytes GitHub takes per step summary
DETAILS_HEADING = "\n## Failures\n"  # report.md's section of full failure outputs


def in_actions(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ACTIONS_ENV, "").lower() == "true"


def _data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(
    test: Mapping[str, Any], file: str, line: int | None, *, quarantined: bool = False
) -> str:
    """One workflow command for a test that is not `pass`."""
    level = "warning" if quarantined else "error"
    title = f"capsafe sweep: {test['classification']}" + (" (quarantined)" if quarantined else "")
    where = f"file={_property(file)}" + (f",line={line}" if line else "")
    text = f"{test['nodeid']}: {test.get('why', '')}"
    if test.get("replay"):
        text += f"\nReproduce: {test['replay']}"
    if fixed := fix_line(test):
        text += f"\n{fixed}"
    return f"::{level} {where},title={_property(title)}::{_data(text)}"


def annotation_lines(
    tests: Sequence[Mapping[str, Any]],
    lines: Mapping[str, int],
    rootdir: Path,
    workspace: Path,
    baseline: frozenset[str] = frozenset(),
) -> list[str]:
    """The commands for every test that is not `pass`, worst first as given; files relative
    to the workspace (the repository checkout), as GitHub places annotations."""
    found = []
    for test in tests:
        if test["classification"] == Verdict.PASS:
            continue
        nodeid = str(test["nodeid"])
        file = os.path.relpath(rootdir / nodeid.split("::", 1)[0], workspace)
        quarantined = nodeid in baseline
        found.append(annotation(test, file, lines.get(nodeid), quarantined=quarantined))
    return found


def step_summary(report_md: str) -> str:
    """report.md as the job summary, without its failure outputs where it is too long."""
    if len(report_md.encode("utf-8")) <= SUMMARY_LIMIT:
        return report_md
    head = report_md.split(DETAILS_HEADING, 1)[0]
    note = "\n_The failure outputs are in report.md and report.html (over GitHub's limit)._\n"
    return head.encode("utf-8")[: SUMMARY_LIMIT - len(note) - 1].decode("utf-8", "ignore") + note


def write_actions_output(
    tests: Sequence[Mapping[str, Any]],
    lines: Mapping[str, int],
    rootdir: Path,
    report_md: str,
    baseline: frozenset[str] = frozenset(),
    *,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
) -> None:
    """Under GitHub Actions: the annotations on stdout and the job summary appended."""
    env = os.environ if env is None else env
    if not in_actions(env):
        return
    out = sys.stdout if stdout is None else stdout
    workspace = Path(env.get(WORKSPACE_ENV) or Path.cwd())
    for command in annotation_lines(tests, lines, rootdir, workspace, baseline):
        print(command, file=out)
    out.flush()
    target = env.get(SUMMARY_ENV)
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(step_summary(report_md) + "\n")
