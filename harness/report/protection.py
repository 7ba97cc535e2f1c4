"""What a sweep made of capture-unsafe tests rerun with `--capsafe-protect`.

`ProtectedRuns` is the one verdict on a capture-unsafe test rerun with the option
(`capsafe sweep --protect`: the sweep's capture phases rerun each one so).
`python -m capsafe_harness.report.protection SWEEP_OUT` lists those verdicts of one sweep;
`python -m capsafe_harness.report.protection UNPROTECTED_OUT PROTECTED_OUT` compares two
sweeps of one suite in one configuration, without and with the option: for each
test the first classified capture-unsafe, whether it passed in the second.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plugin.protect import FRAMEWORKS, OPTION
from ..records import Signal
from ..verdicts.catalogue import Verdict


@dataclass
class ProtectedRuns:
    """A capture-unsafe test rerun with `--capsafe-protect=frameworks` beside the same
    neighbours, and the one verdict on it: `survived` is True when every protected rerun
    passed, False when one failed, None when none ran (no integration applies, or
    `not_run` says why)."""

    frameworks: tuple[str, ...] = ()
    runs: int = 0
    failures: int = 0
    capture_failures: int = 0  # failures with a capture error
    not_run: str = ""

    @property
    def survived(self) -> bool | None:
        if not self.frameworks or not self.runs:
            return None
        return self.failures == 0

    def describe(self, breaks: Sequence[str] = ()) -> str:
        """The report's line; `breaks`: the neighbour call kinds that broke it unprotected."""
        names = ", ".join(self.frameworks)
        if self.not_run:
            return f"with protection: not rerun ({self.not_run})"
        if not self.frameworks:
            return (
                "with protection: no capsafe integration applies (none of "
                f"{', '.join(FRAMEWORKS.values())} is importable in the suite's interpreter)"
            )
        if not self.runs:
            return f"with protection ({names}): the protected reruns did not run it (see the notes)"
        if self.survived:
            return f"with protection: survived {self.runs}/{self.runs} ({names})"
        text = f"still fails {self.failures}/{self.runs} with protection ({names})"
        if not self.capture_failures:
            return f"{text}, not with a capture error (see raw/)"
        return (
            f"{text}: not protectable by capsafe (see docs/integrations.md, {hazard_rows(breaks)})"
        )


def hazard_rows(kinds: Sequence[str]) -> str:
    """The hazard-table rules and rows that neighbour call `kinds` fall under, as
    docs/integrations.md's table names them: `always (ctx_sync); legacy-implicit (...)`."""
    from capsafe import hazards
    from capsafe.hazards.actions import BY_NAME

    found: dict[str, list[str]] = {}
    for row in dict.fromkeys(BY_NAME[k].row for k in kinds):
        for mode in hazards.MODES:
            for stream in hazards.CAPTURE_STREAMS:
                rule = hazards.rule_for(row, mode, stream, hazards.OTHER_THREAD)
                if rule is not None and row not in found.setdefault(rule.name, []):
                    found[rule.name].append(row)
    order = [rule.name for rule in hazards.RULES]
    shown = "; ".join(
        f"{name} ({', '.join(found[name])})" for name in sorted(found, key=order.index)
    )
    return f"hazard rows: {shown}" if shown else "no hazard-table row attributed"


def capture_unsafe(test: dict[str, Any]) -> bool:
    """A sweep summary's test that failed because captures broke (H6's class, or its signal)."""
    if test["classification"] == Verdict.CAPTURE_UNSAFE:
        return True
    return test["classification"] != Verdict.PASS and Signal.CAPTURE_INVALIDATED in test["signals"]


def protected_by(pytest_args: Sequence[str]) -> tuple[str, ...]:
    """The integrations `--capsafe-protect` names in a sweep's pytest arguments (the last
    one given wins, as in pytest)."""
    value = ""
    for i, arg in enumerate(pytest_args):
        if arg.startswith(f"{OPTION}="):
            value = arg.split("=", 1)[1]
        elif arg == OPTION and i + 1 < len(pytest_args):
            value = pytest_args[i + 1]
    return tuple(n.strip() for n in value.split(",") if n.strip())


def _read(out: Path, name: str) -> Any:
    return json.loads((out / name).read_text(encoding="utf-8"))


def survival(unprotected: Path, protected: Path) -> list[tuple[str, str, str, ProtectedRuns]]:
    """(node id, classification without, with protection, the protected runs) for each
    capture-unsafe test of the first sweep, in the second, which ran with `--capsafe-protect`
    in its pytest arguments."""
    before = _read(unprotected, "summary.json")["tests"]
    after = {t["nodeid"]: t for t in _read(protected, "summary.json")["tests"]}
    frameworks = protected_by(_read(protected, "sweep.json")["options"]["pytest_args"])
    rows = []
    for t in before:
        if not capture_unsafe(t):
            continue
        now = after.get(t["nodeid"])
        if now is None:
            rows.append((t["nodeid"], t["classification"], "not run", ProtectedRuns(frameworks)))
            continue
        failures = now["failures"] + now["isolation_failures"]
        runs = ProtectedRuns(
            frameworks, now["runs"] + now["isolation_runs"], failures,
            failures if Signal.CAPTURE_INVALIDATED in now["signals"] else 0,
        )  # fmt: skip
        rows.append((t["nodeid"], t["classification"], now["classification"], runs))
    return rows


def in_one_sweep(out: Path) -> list[tuple[str, ProtectedRuns, str]]:
    """(node id, protected runs, the report's line) for each capture-unsafe test of a sweep
    that reran them with protection itself (`capsafe sweep --protect`)."""
    rows = []
    for t in _read(out, "summary.json")["tests"]:
        if t["classification"] != Verdict.CAPTURE_UNSAFE:
            continue
        capture = t.get("capture") or {}
        if "protection" not in capture:
            raise ValueError(f"{t['nodeid']} has no protected reruns in {out} (an older sweep)")
        runs = ProtectedRuns(
            tuple(capture["protect"]), capture["protected_runs"], capture["protected_failures"]
        )
        rows.append((t["nodeid"], runs, capture["protection"]))
    return rows


USAGE = (
    "usage: python -m capsafe_harness.report.protection SWEEP_OUT  (a sweep run with --protect)\n"
    "       python -m capsafe_harness.report.protection UNPROTECTED_OUT PROTECTED_OUT"
)
LABELS = {True: "survived", False: "NOT protected", None: "no verdict"}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if len(args) == 1:
            lines = [(r.survived, f"{nodeid} ({line})") for nodeid, r, line in in_one_sweep(
                Path(args[0]))]  # fmt: skip
        else:
            lines = [
                (r.survived, f"{nodeid} ({was} without protection, {now} with it)")
                for nodeid, was, now, r in survival(Path(args[0]), Path(args[1]))
            ]
    except (OSError, ValueError, KeyError) as exc:
        print(f"capsafe protect: cannot read the sweeps: {exc}", file=sys.stderr)
        return 2
    for survived, text in lines:
        print(f"{LABELS[survived]}: {text}")
    passed = sum(survived is True for survived, _ in lines)
    print(f"capsafe protect: {passed} of {len(lines)} capture-unsafe tests pass with protection")
    return 0 if lines and passed == len(lines) else 1


if __name__ == "__main__":
    sys.exit(main())
