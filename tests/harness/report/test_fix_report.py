"""A verdict's verified patch and cleaners in report.md and report.html (issue 25): the diff,
how it was found, the command that applies it, and the fixing phase's table."""

from __future__ import annotations

import dataclasses

from test_report import TESTS, summary

from capsafe_harness.report import github, junit
from capsafe_harness.report.html_page import render_html
from capsafe_harness.report.markdown import render_markdown
from capsafe_harness.report.summary import FixRecord, Summary

VICTIM = "t.py::test_victim"
DIFF = ("--- a/t.py\n+++ b/t.py\n@@ -1,2 +1,3 @@\n def test_polluter(monkeypatch):\n"
        "-    registry.add('x')\n+    monkeypatch.setattr(registry, 'PLUGINS', [])\n")  # fmt: skip
FIX = {"path": "t.py", "diff": DIFF, "how": "the registry entry restored by monkeypatch",
       "source": "idiom", "patch": "fixes/t.py_test_victim-1.patch",
       "apply": "capsafe fix reports/today t.py::test_victim"}  # fmt: skip


def fixed_summary() -> Summary:
    tests = [{**t, "fix": FIX, "cleaners": ["t.py::test_reset"]} if t["nodeid"] == VICTIM
             else t for t in TESTS]  # fmt: skip
    found = summary(tests)
    return dataclasses.replace(found, fixes=[
        FixRecord(VICTIM, "order-dependent", ["t.py::test_reset"], 9, True, FIX["how"]),
        FixRecord("t.py::test_needs_setup", "brittle", [], 0, False, "no patch verified"),
    ])  # fmt: skip


def test_the_markdown_shows_the_diff_the_command_and_the_cleaners() -> None:
    text = render_markdown(fixed_summary())
    victim = text[text.index(f"### `{VICTIM}`") :]
    assert "```diff\n" + DIFF.rstrip("\n") + "\n```" in victim
    assert f"Verified fix (idiom, `t.py`): {FIX['how']}" in victim
    assert "```sh\ncapsafe fix reports/today t.py::test_victim\n```" in victim
    assert "Cleaners (run between its polluter and it, it passes): `t.py::test_reset`" in victim
    fixes = text[text.index("## Fixes") :]
    assert "1 of 2 verdicts got a verified patch" in fixes
    assert "| `t.py::test_needs_setup` | brittle | — | 0 | none: no patch verified |" in fixes


def test_the_page_folds_the_diff_under_its_summary() -> None:
    page = render_html(fixed_summary(), {}, [], [])
    assert page.count('<details class="fix">') == 1
    assert f"{FIX['how']}</summary>" in page
    assert (
        '<span class="add">+    monkeypatch.setattr(registry, &#39;PLUGINS&#39;, [])</span>' in page
    )
    assert "capsafe fix reports/today t.py::test_victim" in page
    assert "<h2>Fixes</h2>" in page and "1 of 2 verdicts got a verified patch" in page


def test_a_sweep_without_fix_shows_none_of_it() -> None:
    plain = summary(TESTS)
    assert "Fixes" not in render_markdown(plain) and "Verified fix" not in render_markdown(plain)
    page = render_html(plain, {}, [], [])
    assert "<h2>Fixes</h2>" not in page and 'class="fix"' not in page


def test_ci_outputs_name_the_fix_and_its_command() -> None:
    test = {"nodeid": VICTIM, "classification": "order-dependent", "why": "fails after P",
            "replay": "r", "fix": FIX}  # fmt: skip
    said = f"Verified fix: {FIX['how']}; apply: {FIX['apply']}"
    assert junit._failure_text(test).endswith(said)
    assert said in github.annotation(test, "t.py", 3)
    assert "Verified fix" not in junit._failure_text({**test, "fix": None})
