"""A suite whose xdist workers collide, plain vs swept: what the parallel phase costs.

Measured side by side in one call, from the suite's directory: one plain `pytest -n 2`
of the paths, then `capsafe sweep` of the same paths. Prints the sweep's wall time,
phase times, its processes by kind (and how many of each ran a parallel-unsafe test
last: the searches must have none), the classes, how many parallel-unsafe tests name a
partner, and last the wall-time ratio of the sweep to the plain run.

    python benchmarks/collision_sweep.py                  # repro/suites/collisions, its key
    python benchmarks/collision_sweep.py --suite /tmp/pyfs --paths fs/tests --runs 16 \
        --workers 2 --seed 1 --python /tmp/pyfs-venv/bin/python --limit-s 300

python-fs (issue 21's case) is set up with the public repository at its commit, in a
venv of its own with this checkout installed:

    git clone https://github.com/chaosmail/python-fs /tmp/pyfs
    git -C /tmp/pyfs checkout 2567922ced9387e327e65f3244caff3b7af35684
    python -m venv /tmp/pyfs-venv && /tmp/pyfs-venv/bin/pip install -e '.[harness]'

With no --runs the answer key's sweep options are used and its verdicts checked
(classes, polluters, partners). Exit 0 when every check holds (the key, no search for a
parallel-unsafe test, the ratio at most --limit (8 by default with the key's options),
the wall time at most --limit-s), 1 otherwise. The interpreter (--python) needs capsafe
with its harness extra installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

PLANTED = Path(__file__).resolve().parents[1] / "repro" / "suites" / "collisions"
QUIET = ("--", "-p", "no:run-parallel", "-p", "no:hypothesispytest")
PLANTED_LIMIT = 8.0  # issue 24: a planted collisions suite's sweep, at most 8x its plain run
SEARCH_KINDS = ("replay", "verify")  # processes a polluter or state-setter search starts


def timed(cmd: list[str], cwd: Path) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - started, done.returncode, done.stdout + done.stderr


def kinds(out: Path, unsafe: set[str]) -> tuple[Counter[str], Counter[str]]:
    """Processes by kind (label without its number), and of those, the ones whose
    sequence ended with a parallel-unsafe test."""
    processes = json.loads((out / "sweep.json").read_text())["processes"]
    every: Counter[str] = Counter()
    on_unsafe: Counter[str] = Counter()
    for label in processes:
        kind = label.rsplit("-", 1)[0]
        every[kind] += 1
        replay = out / "raw" / "replays" / f"{label}.txt"
        if (
            replay.is_file()
            and replay.read_text().split()[-1:]
            and (replay.read_text().split()[-1] in unsafe)
        ):
            on_unsafe[kind] += 1
    return every, on_unsafe


def key_problems(summary: dict[str, Any], key: dict[str, Any]) -> list[str]:
    found = {t["nodeid"]: t for t in summary["tests"]}
    problems = []
    for nodeid, test in found.items():
        want = key["tests"].get(nodeid, {"classification": key["default"]})
        got = (test["classification"], test["polluters"], test["collides_with"])
        expected = (want["classification"], want.get("polluters", []),
                    want.get("collides_with", []))  # fmt: skip
        if got != expected:
            problems.append(f"{nodeid}: {got} != key {expected}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", type=Path, default=PLANTED)
    parser.add_argument("--paths", nargs="*", default=["."])
    parser.add_argument("--runs", type=int, default=None, help="default: the answer key's")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--out", type=Path, default=Path("reports/collision_sweep"))
    parser.add_argument("--limit", type=float, default=None,
                        help="sweep / plain, at most (default: 8 with the answer key's "
                        "options, none with --runs: a real suite's plain run can take "
                        "under a second)")  # fmt: skip
    parser.add_argument("--limit-s", type=float, default=None, help="sweep seconds, at most")
    args = parser.parse_args()
    suite = args.suite.resolve()
    key: dict[str, Any] | None = None
    if args.runs is None:
        key = json.loads((suite / "answer_key.json").read_text())
        sweep_opts = [f"--{k.replace('_', '-')}={v}" for k, v in key["sweep"].items()]
    else:
        sweep_opts = [f"--runs={args.runs}", f"--workers={args.workers}", f"--seed={args.seed}"]
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    plain, plain_rc, _ = timed([args.python, "-m", "pytest", *args.paths, "-n", "2", "-q",
                                "-p", "no:cacheprovider"], suite)  # fmt: skip
    print(f"plain pytest -n 2: {plain:.1f} s (exit {plain_rc})")
    sweep = [args.python, "-m", "capsafe.cli", "sweep", *args.paths, *sweep_opts, "--timeout=10",
             "--no-progress", f"--out={out}", *QUIET]  # fmt: skip
    wall, rc, text = timed(sweep, suite)
    if not (out / "summary.json").is_file():
        print(text)
        return 1
    summary = json.loads((out / "summary.json").read_text())
    tests = summary["tests"]
    unsafe = {t["nodeid"] for t in tests if t["classification"] == "parallel-unsafe"}
    every, on_unsafe = kinds(out, unsafe)
    counts = ", ".join(f"{n} {c}" for c, n in summary["counts"].items() if n)
    named = sum(1 for t in tests if t["nodeid"] in unsafe and t["collides_with"])
    print(f"capsafe sweep {' '.join(sweep_opts)}: {wall:.1f} s (exit {rc}); {counts}")
    print(f"  sweep phases (wall s): {json.dumps(summary['phase_times']['sweep_s'])}")
    print(f"  processes by kind: {dict(every)} ({sum(every.values())})")
    print(f"  of those, ending with a parallel-unsafe test: {dict(on_unsafe)}")
    print(f"  parallel-unsafe tests naming a partner: {named} of {len(unsafe)}")
    for t in tests:
        if t["classification"] == "order-dependent":
            print(f"  order-dependent {t['nodeid']} after {' + '.join(t['polluters'])}")
    if summary["notes"]:
        print(f"  first note: {summary['notes'][0]}")
    problems = key_problems(summary, key) if key is not None else []
    problems += [f"{n} search process(es) of kind {k} for a parallel-unsafe test"
                 for k, n in on_unsafe.items() if k in SEARCH_KINDS]  # fmt: skip
    problems += [f"search for parallel-unsafe {s['victim']}" for s in summary["searches"]
                 if s["victim"] in unsafe]  # fmt: skip
    ratio = wall / plain
    limit = args.limit if args.limit is not None or key is None else PLANTED_LIMIT
    if limit is not None and ratio > limit:
        problems.append(f"ratio {ratio:.1f} > {limit:g}")
    if args.limit_s is not None and wall > args.limit_s:
        problems.append(f"sweep {wall:.0f} s > {args.limit_s:g} s")
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"ratio {ratio:.1f}x (sweep {wall:.1f} s / plain {plain:.1f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
