"""A third-party GPU suite under the sweep: CuPy's own graph and stream tests, plain vs swept.

Measured side by side in one call, from the suite's own directory (its conftest and
pytest settings apply): one plain `pytest -n 2` run of the files (the sweep's own worker
count: issue 21 states every cost as a ratio to it) and one plain serial `pytest`, then
`capsafe sweep` of the same files with `--runs 3 --workers 2 --neighbors 2`, then the
same sweep without `--neighbors`. Each sweep writes its reports under --out; this prints,
per sweep, the verdict counts, every capture-unsafe test with the calls that break it,
the phase times, and last the wall-time ratio of the neighbour sweep to the plain
`pytest -n 2` run (and, beside it, to the serial one).

    python benchmarks/cupy_sweep.py --suite .gpu/cupy-v14.2.0 --out reports/gpu

Exit 0 when every done-when line holds (the neighbour sweep classified every test the
plain run ran, named the breaking calls and the capture site of each capture-unsafe test
and gave no `flaky` verdict, the sweep without neighbours found no capture-unsafe test,
the ratio is at most --limit), 1 otherwise. `--files` sweeps another slice.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FILES = (
    "tests/cupy_tests/cuda_tests/test_graph.py",
    "tests/cupy_tests/cuda_tests/test_stream.py",
)
SWEEP = ("--runs", "3", "--workers", "2", "--seed", "11", "--no-progress", "--force")


def timed(
    cmd: list[str], cwd: Path, log: Path, limit: float | None = None
) -> tuple[float, int, str]:
    """(wall seconds, exit code, output) of one command, its output written to `log` as it
    comes (a step cut short by its caller's timeout still leaves what it printed). Past
    `limit` seconds the command gets SIGINT, as Ctrl-C: a sweep then writes its reports for
    what it finished, and says in them that it was interrupted."""
    started = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - started
    return wall, proc.returncode, log.read_text(encoding="utf-8", errors="replace")


def ran_tests(pytest_output: str) -> int:
    """Tests the plain run reported (passed, failed, skipped, xfailed, ... and errors), read
    from pytest's last summary line ("... in 1.23s"): a library may print after it at exit."""
    summaries = [line for line in pytest_output.splitlines()
                 if re.search(r"\bin [\d.]+s\b", line)]  # fmt: skip
    tail = summaries[-1] if summaries else ""
    return sum(int(n) for n, _ in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|error)",
                                            tail))  # fmt: skip


def describe(name: str, wall: float, rc: int, summary: dict[str, Any]) -> list[str]:
    counts = ", ".join(f"{n} {c}" for c, n in summary["counts"].items() if n)
    lines = [f"{name}: {wall:.1f} s, exit {rc}, {len(summary['tests'])} tests: {counts}"]
    times = summary.get("phase_times", {})
    if times:
        lines.append(f"  sweep phases (wall s): {json.dumps(times.get('sweep_s', {}))}")
        lines.append(
            f"  {times.get('processes', 0)} test processes, summed s: "
            f"{json.dumps(times.get('process_s', {}))}"
        )
    for t in (summary.get("gpu") or {}).get("capture_unsafe", []):
        sites = ", ".join(t.get("capture_sites", [])) or "no capture site seen"
        lines.append(f"  capture-unsafe {t['nodeid']} (captured at {sites}): {t['verdict']}")
    for t in summary["tests"]:
        if t["classification"] not in ("pass", "capture-unsafe"):
            lines.append(f"  {t['classification']} {t['nodeid']}: {t['why']}")
    neighbors = (summary.get("gpu") or {}).get("neighbors") or {}
    if neighbors.get("processes"):
        lines.append(f"  neighbour driver errors per kind: {neighbors.get('driver_errors')}")
    lines += [f"  note: {n}" for n in summary.get("notes", [])]
    return lines


def unexplained(summary: dict[str, Any]) -> list[str]:
    """Tests that failed with a capture error without a capture of their own, and whose
    verdict does not name the test that left a capture open (issue 20). A test that fails
    alone every time needs no cause, and one that passed everywhere none either."""
    unsafe = {t["nodeid"] for t in (summary.get("gpu") or {}).get("capture_unsafe", [])}
    return [
        t["nodeid"]
        for t in summary["tests"]
        if "capture-invalidated" in t.get("signals", [])
        and "failed-in-capture" not in t.get("signals", [])
        and t["nodeid"] not in unsafe
        and t["classification"] not in ("pass", "fail")
        and "left a capture open" not in t["why"]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, required=True, help="the CuPy suite folder")
    parser.add_argument("--out", type=Path, required=True, help="reports and logs go here")
    parser.add_argument("--limit", type=float, default=6.0,
                        help="allowed sweep / plain `pytest -n 2` ratio")  # fmt: skip
    parser.add_argument("--files", nargs="+", default=list(FILES),
                        help="test files, relative to --suite (default: CuPy's two)")  # fmt: skip
    parser.add_argument("--neighbors-only", action="store_true",
                        help="skip the sweep without --neighbors (and its check)")  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SEC",
        help="per-test timeout for the plain runs and the sweeps (CuPy's test_device.py "
        "waits forever for a second GPU on a one-GPU host)",
    )  # fmt: skip
    parser.add_argument(
        "--deselect", action="append", default=[], metavar="NODEID",
        help="leave a test out of the plain runs and the sweeps (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=None, metavar="J",
        help="the sweeps' --jobs (replay processes at once; default: the sweep's own)",
    )  # fmt: skip
    parser.add_argument(
        "--sweep-limit", type=float, default=None, metavar="SEC",
        help="interrupt a sweep (SIGINT, as Ctrl-C) after SEC s: it still writes its reports",
    )  # fmt: skip
    args = parser.parse_args(argv)
    suite, out = args.suite.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    capsafe = shutil.which("capsafe") or "capsafe"
    pytest = [sys.executable, "-m", "pytest", *args.files, "-q", "-p", "no:cacheprovider"]
    timeout: list[str] = [] if args.timeout is None else ["--timeout", f"{args.timeout:g}"]
    pytest += timeout
    deselect = [f"--deselect={nodeid}" for nodeid in args.deselect]
    pytest += deselect

    serial_s, serial_rc, serial_out = timed(pytest, suite, out / "cupy_plain_serial.log")
    plain_s, plain_rc, plain_out = timed([*pytest, "-n", "2"], suite, out / "cupy_plain.log")
    plain_tests = ran_tests(plain_out)
    serial_tests = ran_tests(serial_out)
    print(f"plain pytest -n 2: {plain_s:.1f} s, exit {plain_rc}, {plain_tests} tests; "
          f"serial pytest: {serial_s:.1f} s, exit {serial_rc}, {serial_tests} tests")  # fmt: skip

    results = {}
    sweeps = [("cupy_sweep_neighbors", ["--neighbors", "2"]), ("cupy_sweep_plain", [])]
    for name, extra in sweeps[:1] if args.neighbors_only else sweeps:
        report = out / name
        cmd = [capsafe, "sweep", *args.files, *SWEEP, *extra, *timeout, "--out", str(report)]
        cmd += [] if args.jobs is None else ["--jobs", str(args.jobs)]
        cmd += ["--", *deselect] if deselect else []
        wall, rc, _ = timed(cmd, suite, out / f"{name}.log", args.sweep_limit)
        try:
            summary = json.loads((report / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            print(f"{name}: {wall:.1f} s, exit {rc}, no summary.json (see {name}.log)")
            return 1
        results[name] = (wall, summary)
        print("\n".join(describe(name, wall, rc, summary)))

    swept_s, swept = results["cupy_sweep_neighbors"]
    unsafe = (swept.get("gpu") or {}).get("capture_unsafe", [])
    checks = {
        "every test classified": len(swept["tests"]) >= plain_tests > 0,
        "breaking calls named": bool(unsafe) and all(t["breaks"] for t in unsafe),
        "capture sites named": all(t.get("capture_sites") for t in unsafe),
        "no flaky verdict": swept["counts"].get("flaky", 0) == 0,
        "capture errors of non-capturing tests explained": not unexplained(swept),
        "finished": not swept.get("interrupted"),
        "no capture-unsafe without --neighbors": args.neighbors_only
        or (results["cupy_sweep_plain"][1]["counts"].get("capture-unsafe", 0) == 0),
        f"ratio <= {args.limit:g}": swept_s / plain_s <= args.limit,
    }
    for nodeid in unexplained(swept):
        print(f"  unexplained capture error: {nodeid}")
    for check, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {check}")
    print(f"ratio sweep --neighbors 2 / plain pytest -n 2: {swept_s / plain_s:.1f} "
          f"({swept_s:.1f} s / {plain_s:.1f} s; serial pytest {serial_s:.1f} s: "
          f"{swept_s / serial_s:.1f}x)")  # fmt: skip
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
