"""What a sweep costs: `capsafe sweep --runs N` against one plain `pytest -n W`, side by side.

Two suites, each measured in one call so machine load hits both sides alike:

- a real suite (`--suite DIR [--paths tests]`, swept with the interpreter `--python`,
  which needs capsafe[harness] and the suite's requirements): one plain run before each
  sweep and one after the last, then `--runs` for each count of `--counts` (5,20); prints
  each sweep's wall time as a multiple of the plain runs' median, its phase times,
  process count and the peak RSS of the sweep process alone and of its process tree
  (read from /proc: Linux only);
- `--per-run K` (with `--suite`): the plugin's cost per suite run, K plain runs and K runs
  of the exact command a sweep's suite run uses (built by the sweep's own runner: records,
  seed, shuffle, seeded worker split, timeout), alternated; prints the medians of wall and
  of CPU seconds (the processes' user + system time, which load distorts less than wall);
- `--synthetic N`: N trivial tests in 10 files with 3 planted polluter/victim pairs,
  generated into a temporary directory and swept with `--runs 3` (two plain runs before
  it and one after, their median the base); checks that every
  victim a run exposed (it failed in a suite run) is order-dependent after its own
  polluter, and that no other test got a verdict.

python-dateutil 2.9.0 (2,095 tests), as docs/harness.md measured it:

    python -m venv /tmp/du/venv && /tmp/du/venv/bin/pip install -e '.[harness]' \\
        python-dateutil==2.9.0 pytest==9.0.3 hypothesis freezegun pytest-cov
    /tmp/du/venv/bin/pip download python-dateutil==2.9.0 --no-binary :all: --no-deps -d /tmp/du
    tar xzf /tmp/du/python-dateutil-2.9.0.tar.gz -C /tmp/du
    python benchmarks/sweep_cost.py --suite /tmp/du/python-dateutil-2.9.0 \\
        --python /tmp/du/venv/bin/python --counts 5,20 --per-run 3
    python benchmarks/sweep_cost.py --synthetic 500,2000

The last line holds the ratios; exit 1 when a done-when bound (--limit, --rss-limit,
--synthetic-limit) or a synthetic verdict check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PAIRS = 3  # planted polluter/victim pairs of the synthetic suite
FILES = 10  # files the synthetic suite's trivial tests are spread over
SWEEP = ("--seed", "1", "--no-progress", "--force")
CLI = "import sys; from capsafe.cli import main; sys.exit(main())"  # `capsafe` of --python


class TreeMemory:
    """Peak RSS of one process and of it with all its descendants, polled from /proc."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.pid = pid
        self.own_peak = 0  # bytes: the kernel's own high-water mark (VmHWM), last read
        self.tree_peak = 0  # bytes: the largest summed RSS of the tree seen by a poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(every,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self, every: float) -> None:
        while not self._stop.is_set():
            hwm = _status_kb(self.pid, "VmHWM")
            if hwm:
                self.own_peak = max(self.own_peak, hwm * 1024)
            tree = _descendants(self.pid) | {self.pid}
            self.tree_peak = max(self.tree_peak, sum(_status_kb(p, "VmRSS") * 1024 for p in tree))
            self._stop.wait(every)


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _descendants(root: int) -> set[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def timed(cmd: list[str], cwd: Path, log: Path) -> tuple[float, int, TreeMemory]:
    """(wall seconds, exit code, its memory) of one command, its output in `log`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPSAFE_", "PYTEST_"))}
    with open(log, "wb") as out:
        started = time.perf_counter()
        process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        memory = TreeMemory(process.pid)
        rc = process.wait()
        wall = time.perf_counter() - started
    memory.stop()
    return wall, rc, memory


def plain(python: str, paths: list[str], workers: int, cwd: Path, log: Path) -> float:
    wall, rc, _ = timed([python, "-m", "pytest", *paths, f"-n={workers}", "-q",
                         "-p", "no:cacheprovider"], cwd, log)  # fmt: skip
    if rc not in (0, 1):
        sys.exit(f"the plain run exited {rc}: see {log}")
    return wall


# The command of a sweep's suite run k, as the sweep's runner builds it (after collection).
RUN_COMMAND = """
import json, sys
from pathlib import Path
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.runner import Runner
from capsafe_harness.sweep.runs import run_seeds, shuffle_of
out, workers, k, paths = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
options = SweepOptions(paths=tuple(Path(p).resolve() for p in paths), out=out, seed=1,
                       workers=workers, fork=False, invoked_from=Path.cwd())
runner = Runner(options, out / "raw")
runner.collect()
label = f"run-{k}"
print(json.dumps(runner.pytest_command(runner.targets(), out / "raw" / label, label,
      seed=run_seeds(1, k)[k - 1], workers=workers, shuffle=shuffle_of(k))))
"""


def cpu_seconds() -> float:
    """User + system seconds of every finished child so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def per_run(args: argparse.Namespace, suite: Path, out: Path) -> str:
    """K plain runs against K runs of a sweep's suite-run command (runs 1 and 2 in turn:
    a global and a bucketed shuffle), alternated; medians of wall and CPU seconds."""
    commands = []
    for k in (1, 2):
        built = subprocess.run([args.python, "-c", RUN_COMMAND, str(out / "per-run"),
                                str(args.workers), str(k), *args.paths], cwd=suite,
                               capture_output=True, text=True, check=False)  # fmt: skip
        if built.returncode:
            sys.exit(f"could not build the sweep's run command: {built.stderr[-2000:]}")
        commands.append(json.loads(built.stdout.splitlines()[-1]))
    plain_cmd = [args.python, "-m", "pytest", *args.paths, f"-n={args.workers}", "-q",
                 "-p", "no:cacheprovider"]  # fmt: skip
    samples: dict[str, list[tuple[float, float]]] = {"plain": [], "sweep run": []}
    for k in range(args.per_run):
        order = [("plain", plain_cmd), ("sweep run", commands[k % 2])]
        for name, cmd in order if k % 2 == 0 else order[::-1]:
            shutil.rmtree(out / "per-run" / "raw", ignore_errors=True)
            (out / "per-run" / "raw").mkdir(parents=True)
            before = cpu_seconds()
            seconds, rc, _ = timed(cmd, suite, out / f"per-run-{k}-{name.replace(' ', '-')}.log")
            if rc not in (0, 1):
                sys.exit(f"{name} exited {rc}: see {out}/per-run-{k}-*.log")
            samples[name].append((seconds, cpu_seconds() - before))
    wall = {n: statistics.median(w for w, _ in s) for n, s in samples.items()}
    cpu = {n: statistics.median(c for _, c in s) for n, s in samples.items()}
    for name, s in samples.items():
        print(f"{name}: wall {', '.join(f'{w:.1f}' for w, _ in s)} s; "
              f"CPU {', '.join(f'{c:.1f}' for _, c in s)} s")  # fmt: skip
    ratio = (f"per run (sweep's suite run / plain, median of {args.per_run}): "
             f"wall {wall['sweep run'] / wall['plain']:.2f}x, "
             f"CPU {cpu['sweep run'] / cpu['plain']:.2f}x")  # fmt: skip
    print(ratio)
    return ratio


def sweep(
    python: str, paths: list[str], runs: int, workers: int, cwd: Path, out: Path
) -> tuple[float, TreeMemory, dict[str, Any]]:
    cmd = [python, "-c", CLI, "sweep", *paths, "--runs", str(runs), "--workers", str(workers),
           *SWEEP, "--out", str(out)]  # fmt: skip
    wall, rc, memory = timed(cmd, cwd, out.with_suffix(".log"))
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        sys.exit(f"sweep --runs {runs} exited {rc} with no summary.json: see {out}.log")
    return wall, memory, summary


def describe(name: str, wall: float, base: float, memory: TreeMemory, s: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {c}" for c, n in s["counts"].items() if n)
    times = s.get("phase_times", {})
    return (f"{name}: {wall:.1f} s = {wall / base:.1f}x plain; {len(s['tests'])} tests: {counts}\n"
            f"  sweep phases (wall s): {json.dumps(times.get('sweep_s', {}))}\n"
            f"  {times.get('processes', 0)} test processes, summed s: "
            f"{json.dumps(times.get('process_s', {}))}\n"
            f"  peak RSS: sweep process {memory.own_peak / 2**20:.0f} MB, "
            f"process tree {memory.tree_peak / 2**20:.0f} MB")  # fmt: skip


# ---------------------------------------------------------------- the synthetic suite
def write_synthetic(root: Path, tests: int) -> dict[str, str]:
    """N trivial tests with PAIRS polluter/victim pairs; {victim node id: polluter's}.

    Each polluter sets a flag in a shared module that its victim asserts unset, so a
    victim fails exactly when its polluter ran before it in the same process."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "shared_state.py").write_text("FLAGS: set[str] = set()\n")
    (root / "conftest.py").write_text(
        "import sys, os\nsys.path.insert(0, os.path.dirname(__file__))\n"
    )
    per_file = [tests // FILES + (k < tests % FILES) for k in range(FILES)]
    key, planted = {}, 0
    for k, count in enumerate(per_file):
        lines = ["import shared_state\n"]
        trivial = count - (2 if planted < PAIRS and k % 3 == 0 else 0)
        lines += [f"\ndef test_trivial_{i}():\n    assert {i} + 1 == {i + 1}\n"
                  for i in range(trivial)]  # fmt: skip
        if trivial < count:
            flag = f"pair{planted}"
            lines.append(
                f"\ndef test_polluter_{planted}():\n    shared_state.FLAGS.add({flag!r})\n"
            )
            lines.append(f"\ndef test_victim_{planted}():\n    assert {flag!r} not in "
                         "shared_state.FLAGS\n")  # fmt: skip
            name = f"test_file_{k}.py"
            key[f"{name}::test_victim_{planted}"] = f"{name}::test_polluter_{planted}"
            planted += 1
        (root / f"test_file_{k}.py").write_text("".join(lines))
    return key


def synthetic_checks(summary: dict[str, Any], key: dict[str, str]) -> dict[str, bool]:
    """Every victim a run exposed (it failed in a suite run) is order-dependent after its own
    polluter, as is any other victim the sweep flagged; no test outside the key is flagged."""
    by_id = {t["nodeid"]: t for t in summary["tests"]}
    exposed = [v for v in key if by_id.get(v, {}).get("failures", 0)]
    flagged = [v for v in key if by_id.get(v, {}).get("classification", "pass") != "pass"]
    checks = {f"{len(exposed)} of {len(key)} victims exposed by a run": bool(exposed)}
    for victim in sorted({*exposed, *flagged}):
        t = by_id[victim]
        checks[f"{victim}: order-dependent after {key[victim]}"] = t[
            "classification"
        ] == "order-dependent" and t["polluters"] == [key[victim]]
    others = [t["nodeid"] for t in summary["tests"]
              if t["classification"] != "pass" and t["nodeid"] not in key]  # fmt: skip
    checks[f"no test outside the key flagged ({', '.join(others[:3]) or 'none'})"] = not others
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, help="a real suite's root (pytest runs there)")
    parser.add_argument("--paths", nargs="+", default=["tests"], help="test paths in --suite")
    parser.add_argument("--python", default=sys.executable, help="the suite's interpreter")
    parser.add_argument("--counts", default="5,20", help="--runs of each sweep of --suite")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--per-run", type=int, default=0, help="plain/sweep-run pairs (K)")
    parser.add_argument("--synthetic", default="", help="synthetic suite sizes: 500,2000")
    parser.add_argument("--out", type=Path, help="keep reports and logs here")
    parser.add_argument("--limit", type=float, default=21.0, help="--runs 20 / plain at most")
    parser.add_argument("--rss-limit", type=float, default=1.3, help="peak RSS 20 / 5 at most")
    parser.add_argument("--synthetic-limit", type=float, default=5.0)
    args = parser.parse_args(argv)
    if not args.suite and not args.synthetic:
        parser.error("give --suite DIR, --synthetic N, or both")
    keep = args.out.resolve() if args.out else None
    with tempfile.TemporaryDirectory() as tmp:
        out = keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        checks: dict[str, bool] = {}
        ratios: list[str] = []
        if args.suite and args.per_run:
            ratios.append(per_run(args, args.suite.resolve(), out))
        if args.suite and args.counts:
            counts = [int(c) for c in args.counts.split(",")]
            real_checks, real_ratios = measure_real(args, args.suite.resolve(), counts, out)
            checks |= real_checks
            ratios += real_ratios
        for tests in [int(n) for n in args.synthetic.split(",") if n]:
            syn_checks, syn_ratios = measure_synthetic(args, tests, out)
            checks |= syn_checks
            ratios += syn_ratios
        if keep is None:
            shutil.rmtree(out / "synthetic-suite", ignore_errors=True)
    for check, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {check}")
    print("ratios: " + "; ".join(ratios))
    return 0 if all(checks.values()) else 1


def measure_real(
    args: argparse.Namespace, suite: Path, counts: list[int], out: Path
) -> tuple[dict[str, bool], list[str]]:
    plains = [plain(args.python, args.paths, args.workers, suite, out / "plain-0.log")]
    results = {}
    for runs in counts:
        wall, memory, summary = sweep(args.python, args.paths, runs, args.workers, suite,
                                      out / f"sweep-runs-{runs}")  # fmt: skip
        plains.append(plain(args.python, args.paths, args.workers, suite,
                            out / f"plain-{len(plains)}.log"))  # fmt: skip
        results[runs] = (wall, memory, summary)
    base = statistics.median(plains)
    print(f"plain pytest -n {args.workers}: median {base:.1f} s of "
          f"{', '.join(f'{p:.1f}' for p in plains)}")  # fmt: skip
    for runs, (wall, memory, summary) in results.items():
        print(describe(f"sweep --runs {runs}", wall, base, memory, summary))
    ratios = [f"runs {r}: {w / base:.1f}x" for r, (w, _, _) in results.items()]
    checks = {}
    top, low = max(counts), min(counts)
    checks[f"--runs {top} at most {args.limit:g}x plain"] = results[top][0] / base <= args.limit
    if top != low:
        rss = results[top][1].own_peak / max(1, results[low][1].own_peak)
        checks[f"peak RSS --runs {top} at most {args.rss_limit:g}x --runs {low}"] = (
            rss <= args.rss_limit
        )
        ratios.append(f"peak RSS runs {top}/{low}: {rss:.2f}x")
    return checks, ratios


def measure_synthetic(
    args: argparse.Namespace, tests: int, out: Path
) -> tuple[dict[str, bool], list[str]]:
    root = out / "synthetic-suite"
    shutil.rmtree(root, ignore_errors=True)
    key = write_synthetic(root, tests)
    py = args.python
    # Two plain runs before the sweep and one after, their median the base: one run each
    # side was 2-5x apart on the loaded machine, and a median of two is their mean.
    plains = [plain(py, ["."], args.workers, root, out / f"synthetic-{tests}-plain-{k}.log")
              for k in range(2)]  # fmt: skip
    wall, memory, summary = sweep(py, ["."], 3, args.workers, root, out / f"synthetic-{tests}")
    plains.append(plain(py, ["."], args.workers, root, out / f"synthetic-{tests}-plain-2.log"))
    base = statistics.median(plains)
    print(f"synthetic, {tests} tests: plain pytest median {base:.1f} s "
          f"({', '.join(f'{p:.1f}' for p in plains)})")  # fmt: skip
    print(describe(f"synthetic {tests} sweep --runs 3", wall, base, memory, summary))
    checks = {f"synthetic {tests}: {c}": ok for c, ok in synthetic_checks(summary, key).items()}
    checks[f"synthetic {tests} --runs 3 at most {args.synthetic_limit:g}x plain"] = (
        wall / base <= args.synthetic_limit
    )
    return checks, [f"synthetic {tests}: {wall / base:.1f}x"]


if __name__ == "__main__":
    sys.exit(main())
