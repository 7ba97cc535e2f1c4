"""What pytest collects, as the sweep's first step: the node ids and the collection errors.

Loaded into one `pytest --collect-only` process with `-p capsafe_harness.plugin.collection`;
it writes the collected ids (exactly as `pytest --collect-only -q` prints them,
since it runs from the same directory with the same arguments) and every file that
could not be collected, with pytest's message, as JSON to the path in
COLLECT_OUT_ENV. An environment variable and not an option: an option's value
that is an existing path would sway pytest's choice of rootdir, and so the ids.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import randomly

COLLECT_OUT_ENV = "CAPSAFE_COLLECT_OUT"
PLUGIN = "capsafe_harness.plugin.collection"


@dataclass(frozen=True)
class Collected:
    """The suite as pytest sees it: test ids in collection order, errors by node id, and
    the rootdir the ids are relative to and the configuration file pytest chose ("" for
    none): every later process is pinned to both, since a narrower list of paths could
    make pytest choose others (a suite directory with its own pytest.ini)."""

    nodeids: tuple[str, ...]
    errors: dict[str, str]
    rootdir: str
    inifile: str = ""
    timeout: float | None = None  # the project's own pytest-timeout seconds; None: it sets none
    timeout_source: str = ""  # where that came from, in words
    timeout_method: str = ""  # the project's own timeout method; "": it sets none
    lines: dict[str, int] = field(default_factory=dict, compare=False)  # node id -> its line
    randomly: bool = False  # pytest-randomly is loaded in the suite's pytest


_errors: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    """The project's own order: pytest-randomly (where loaded) does not reorder it."""
    randomly.keep_order(config)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _errors[report.nodeid or "."] = report.longreprtext


def project_timeout(config: pytest.Config) -> tuple[float | None, str, str]:
    """The project's own pytest-timeout settings, looked up in pytest-timeout's order
    (its option, from addopts or the sweep's `-- ARGS`; PYTEST_TIMEOUT; the ini's
    `timeout`): (seconds or None, where from, method or ""). None where pytest-timeout is
    not loaded here."""
    if not config.pluginmanager.has_plugin("timeout"):
        return None, "", ""
    method = str(config.getoption("timeout_method", None) or config.getini("timeout_method"))
    given = config.getoption("timeout", None)
    if given is not None:
        return (
            float(given),
            "the --timeout in the project's addopts or the pytest arguments",
            method,
        )
    env = os.environ.get("PYTEST_TIMEOUT", "").strip()
    if env:
        return float(env), "the PYTEST_TIMEOUT environment variable", method
    ini = str(config.getini("timeout") or "").strip()
    if ini:
        where = config.inipath.name if config.inipath is not None else "the ini file"
        return float(ini), f"timeout in {where}", method
    return None, "", method


def _line(item: pytest.Item) -> int:
    """The 1-based line a test is defined on (0: unknown), where a CI annotation points."""
    lineno = item.location[1]
    return lineno + 1 if lineno is not None else 0


def pytest_collection_finish(session: pytest.Session) -> None:
    path = os.environ.get(COLLECT_OUT_ENV)
    if not path:
        return
    timeout, source, method = project_timeout(session.config)
    found = {
        "nodeids": [item.nodeid for item in session.items],
        "errors": _errors,
        "rootdir": str(session.config.rootpath),
        "inifile": str(session.config.inipath or ""),
        "timeout": timeout,
        "timeout_source": source,
        "timeout_method": method,
        "lines": {item.nodeid: _line(item) for item in session.items},
        "randomly": randomly.installed(session.config),
    }
    Path(path).write_text(json.dumps(found), encoding="utf-8")


def read_collected(path: Path) -> Collected | None:
    """What the collection process wrote; None when it never got that far."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return Collected(
        tuple(found["nodeids"]),
        dict(found["errors"]),
        str(found["rootdir"]),
        str(found.get("inifile", "")),
        None if found.get("timeout") is None else float(found["timeout"]),
        str(found.get("timeout_source", "")),
        str(found.get("timeout_method", "")),
        {str(k): int(v) for k, v in found.get("lines", {}).items() if v},
        bool(found.get("randomly", False)),
    )
