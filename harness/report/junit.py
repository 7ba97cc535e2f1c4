"""The sweep's verdicts as JUnit XML (`capsafe sweep --junitxml FILE`), for CI systems.

One testcase per test, named as pytest's own --junitxml names it (classname: the file's
dotted path and the class; name: the function with its parameters), in the elements
and attributes of the JUnit schema pytest's output follows (testsuites > testsuite >
properties, testcase > failure | error | skipped, with the attributes pytest gives
them). A test that is not `pass` is a failure whose message is its class and the
sweep's cause; its text holds the failure and the replay line. A collection error
is a failure too ("error: ModuleNotFoundError: ..."): the schema (junit-10.xsd, which
pytest's own test suite validates its output with) has no `error` element, only
`errors`, so pytest's own XML for a collection error does not validate; the sweep's
does. Skipped and
xfailed tests are skipped (never a pass), and so is a quarantined test (--baseline),
whose verdict is kept in the message: a CI system then agrees with the sweep's exit
code.
"""

from __future__ import annotations

import os
import socket
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..verdicts.catalogue import Verdict
from .shared import fix_line
from .summary import Summary

SUITE_NAME = "capsafe sweep"
NOT_RUN = ("skipped", "xfailed")  # outcomes of a test classed pass that JUnit calls skipped


def names(nodeid: str) -> tuple[str, str]:
    """(classname, name) as pytest's junitxml makes them from a node id."""
    parts = nodeid.split("::")
    path = parts[0].replace("\\", "/")
    if path.endswith(".py"):
        path = path[: -len(".py")]
    dotted = [path.replace("/", "."), *parts[1:]]
    return ".".join(dotted[:-1]), dotted[-1]


def _message(test: Mapping[str, Any]) -> str:
    """ "order-dependent: fails after tests/test_a.py::test_a ...": the class, then the cause
    (or, for a collection error, pytest's last line)."""
    why = str(test.get("why") or "")
    said = str(test.get("message") or "").strip()
    if said and (not why or test["classification"] == Verdict.ERROR):
        why = said.splitlines()[-1]
    return f"{test['classification']}: {why}" if why else str(test["classification"])


def _failure_text(test: Mapping[str, Any]) -> str:
    lines = [_message(test)]
    if test.get("details") or test.get("message"):
        lines += ["", str(test.get("details") or test.get("message"))]
    if test.get("replay"):
        lines += ["", "Reproduce:", str(test["replay"])]
    if fixed := fix_line(test):
        lines += ["", fixed]
    return "\n".join(lines)


def junit_tree(
    summary: Summary, tests: Sequence[Mapping[str, Any]], baseline: frozenset[str] = frozenset()
) -> ET.ElementTree[ET.Element]:
    """The XML of `tests` (the per-test table of harness.report.tables)."""
    suites = ET.Element("testsuites", name=SUITE_NAME)
    suite = ET.SubElement(suites, "testsuite", name=SUITE_NAME)
    properties = ET.SubElement(suite, "properties")
    facts = {
        "runs": str(summary.runs), "workers": str(summary.workers),
        "seeds": ",".join(map(str, summary.seeds)), "backend": summary.backend,
        "timeout": summary.timeout, "interrupted": summary.interrupted, "shard": summary.shard,
    }  # fmt: skip
    for name, value in facts.items():
        if value:
            ET.SubElement(properties, "property", name=name, value=value)
    failures = skipped = 0
    for test in tests:
        classname, name = names(str(test["nodeid"]))
        case = ET.SubElement(suite, "testcase", classname=classname, name=name)
        verdict = str(test["classification"])
        if test["nodeid"] in baseline and verdict != Verdict.PASS:
            skipped += 1
            why = f"quarantined by the baseline: {verdict}: {test.get('why', '')}"
            ET.SubElement(case, "skipped", type="quarantined", message=why)
        elif verdict != Verdict.PASS:
            failures += 1
            failure = ET.SubElement(case, "failure", message=_message(test))
            failure.text = _failure_text(test)
        elif test.get("outcome") in NOT_RUN:
            skipped += 1
            ET.SubElement(case, "skipped", type=str(test["outcome"]),
                          message=" ".join(str(test.get("message", "")).split()))  # fmt: skip
    counts = {"tests": len(tests), "failures": failures, "errors": 0, "skipped": skipped}
    for key, n in counts.items():
        suite.set(key, str(n))
    suite.set("time", f"{summary.duration_s:.3f}")
    suite.set("timestamp", datetime.now(UTC).isoformat(timespec="seconds"))
    suite.set("hostname", socket.gethostname())
    ET.indent(suites)
    return ET.ElementTree(suites)


def write_junit(
    path: str | os.PathLike[str],
    summary: Summary,
    tests: Sequence[Mapping[str, Any]],
    baseline: frozenset[str] = frozenset(),
) -> None:
    """Write the JUnit XML to `path` (its directory made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    junit_tree(summary, tests, baseline).write(path, encoding="utf-8", xml_declaration=True)
