"""Sweep every planted suite and the shared real-world cases with fixed seeds, and keep
what the verdicts say (classes, causes, counts, searches), not how long they took.

A harness change that must not change behaviour (issue 19's reshape) is checked by
taking a snapshot before and after it and diffing the two:

    python tools/sweep_snapshot.py --out /tmp/before     # on the old tree
    python tools/sweep_snapshot.py --out /tmp/after      # on the new tree
    python tools/sweep_snapshot.py --compare /tmp/before /tmp/after

Real-world cases get one virtual environment each (system site packages plus the case's
requirements and an editable install of this tree), kept under --venvs between snapshots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "repro" / "suites"
REALWORLD = Path(os.environ.get("CAPSAFE_REALWORLD", ROOT.parent / "shared" / "realworld"))
FAST = ["--", "-p", "no:run-parallel", "-p", "no:hypothesispytest"]
REALWORLD_SWEEP = {
    "freezegun": ["--runs", "6", "--workers", "2", "--seed", "1"],
    "configaro": ["--runs", "4", "--workers", "2", "--seed", "1"],
    "colltools": ["--runs", "4", "--workers", "2", "--seed", "1"],
    "PyJsonFriendly": ["--runs", "8", "--workers", "2", "--seed", "1"],
    "NestedDictionary": ["--runs", "4", "--workers", "2", "--seed", "1"],
    "envyaml": ["--runs", "4", "--workers", "2", "--seed", "1"],
}
DIGITS = re.compile(r"\d+(\.\d+)?")


def essence(summary: dict[str, Any]) -> dict[str, Any]:
    """What a verdict says: everything but timings, paths and replay file names."""
    tests: dict[str, dict[str, Any]] = {}
    for t in summary["tests"]:
        tests[t["nodeid"]] = {
            "classification": t["classification"],
            "polluters": t["polluters"],
            "state_setters": t["state_setters"],
            "signals": sorted(t["signals"]),
            "collides_with": t.get("collides_with", []),
            "why": DIGITS.sub("N", t["why"]),
        }
    return {
        "counts": summary["counts"],
        "seeds": summary["seeds"],
        "shuffles": summary["shuffles"],
        "tests": tests,
        "searches": sorted(
            (s["victim"], s["kind"], s["culprits"], s["verified"]) for s in summary["searches"]
        ),
        "notes": [DIGITS.sub("N", n) for n in summary["notes"]],
        "suite_errors": len(summary.get("suite_errors", [])),
    }


def sweep(python: str, cwd: Path, args: list[str], out: Path) -> dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run(
        [python, "-m", "capsafe.cli", "sweep", "--no-progress", "--out", str(out), *args],
        cwd=cwd, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    took = time.monotonic() - started
    print(f"  exit {done.returncode} in {took:.0f} s", flush=True)
    if not (out / "summary.json").is_file():
        return {"exit": done.returncode, "stderr": done.stderr[-2000:]}
    return {"exit": done.returncode, **essence(json.loads((out / "summary.json").read_text()))}


def planted(out: Path, only: set[str]) -> None:
    for key_path in sorted(SUITES.glob("*/answer_key.json")):
        name = key_path.parent.name
        if only and name not in only:
            continue
        options = json.loads(key_path.read_text()).get("sweep", {})
        args = [str(key_path.parent), "--timeout", "10"]
        for option, value in options.items():
            args += [f"--{option.replace('_', '-')}", str(value)]
        print(f"planted {name}", flush=True)
        result = sweep(sys.executable, ROOT, [*args, *FAST], out / "reports" / name)
        (out / f"planted-{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True))


def realworld(out: Path, venvs: Path, only: set[str]) -> None:
    cases = json.loads((REALWORLD / "cases.json").read_text())
    for case in cases:
        name = case["name"]
        if only and name not in only:
            continue
        print(f"realworld {name}", flush=True)
        env = venvs / name
        src = env / "src"
        if not (env / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env)],
                           check=True)  # fmt: skip
            subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "-U",
                            "setuptools>=77", *case["requirements"]], check=True)  # fmt: skip
            with tarfile.open(REALWORLD / case["archive"]) as archive:
                archive.extractall(src, filter="data")
        subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "-e", str(ROOT)], check=True)  # fmt: skip
        args = [*case["paths"], "--timeout", "30", *REALWORLD_SWEEP[name],
                "--", *case.get("pytest_args", [])]  # fmt: skip
        result = sweep(str(env / "bin" / "python"), src, args, out / "reports" / name)
        (out / f"realworld-{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True))


def compare(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.glob("*.json")} | {p.name for p in after.glob("*.json")})
    differ = 0
    for name in names:
        a, b = before / name, after / name
        if not (a.is_file() and b.is_file()):
            print(f"{name}: only in {'before' if a.is_file() else 'after'}")
            differ += 1
            continue
        if json.loads(a.read_text()) != json.loads(b.read_text()):
            print(f"{name}: differs")
            subprocess.run(["diff", str(a), str(b)])
            differ += 1
    print(f"{len(names) - differ} of {len(names)} snapshots identical")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where to write the snapshot")
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/capsafe-snapshot-venvs"))
    parser.add_argument("--only", nargs="*", default=[], help="suite or case names")
    parser.add_argument("--no-realworld", action="store_true")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("--out or --compare is required")
    args.out.mkdir(parents=True, exist_ok=True)
    planted(args.out, set(args.only))
    if not args.no_realworld and (REALWORLD / "cases.json").is_file():
        realworld(args.out, args.venvs, set(args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
