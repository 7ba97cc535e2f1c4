"""The end of `capsafe sweep`'s and `capsafe merge`'s console output."""

from __future__ import annotations

import shlex

from ..report.shared import worst_first
from ..report.summary import TestVerdict
from ..verdicts.catalogue import Verdict
from .run import SweepResult

WORST_SHOWN = 10  # tests the console lists at the end


def cause_of(test: TestVerdict) -> str:
    """The cause column of the console summary."""
    if test.polluters:
        return "after " + " + ".join(test.polluters)
    if test.state_setters:
        return "passes after " + " + ".join(test.state_setters)
    if test.collides_with:
        return "collides with " + ", ".join(test.collides_with)
    if test.concurrent:
        return "beside " + ", ".join(test.concurrent[:3]) + (" ..." if len(test.concurrent) > 3
                                                              else "")  # fmt: skip
    if test.classification == Verdict.ERROR:
        return test.message.strip().splitlines()[-1] if test.message.strip() else ""
    return test.why


def console_lines(result: SweepResult) -> list[str]:
    """The end of the console output: the worst tests (class, test, cause), then the verdict."""
    bad = worst_first([t.__dict__ for t in result.summary.tests])
    shown = [t for t in bad if t["classification"] != Verdict.PASS][:WORST_SHOWN]
    by_id = {t.nodeid: t for t in result.summary.tests}
    lines = [f"  {t['classification']:<16} {t['nodeid']}  {cause_of(by_id[t['nodeid']])}"
             for t in shown]  # fmt: skip
    more = sum(t.classification != Verdict.PASS for t in result.summary.tests) - len(shown)
    if more > 0:
        lines.append(f"  ... and {more} more in the report")
    return [*lines, *fix_lines(result), result.reason]


def fix_lines(result: SweepResult) -> list[str]:
    """With --fix: how many verdicts got a verified patch, and the command that applies them."""
    fixes = result.summary.fixes
    if not fixes:
        return []
    patched = [t.fix for t in result.summary.tests if t.fix]
    line = f"  fixes: {len(patched)} of {len(fixes)} verdicts got a verified patch"
    if patched:
        every = shlex.join(shlex.split(str(patched[0]["apply"]))[:-1])  # without its test
        line += f"; apply them all with `{every}`"
    return [line]
