"""What the fork server saves: N single-test replays, fresh processes vs forked children.

Each replay is built by the sweep's Runner as an isolation rerun is (one test,
`--capsafe-replay`, records on) and run through `LocalExecutor` (a new interpreter,
plugins, imports and collection each time) and through `ForkExecutor` (one server
collects once, each replay a forked child), alternating so that drift in machine load
hits both. The forked side's total includes starting its server. Prints both totals
and per-replay medians, then the ratio (fresh / forked) as the last line.

    python benchmarks/fork_server.py [--suite repro/suites/polluter] [--replays 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from capsafe_harness.plugin import order
from capsafe_harness.sweep.executor import LocalExecutor
from capsafe_harness.sweep.fork_executor import ForkExecutor
from capsafe_harness.sweep.options import SweepOptions
from capsafe_harness.sweep.runner import Runner

ROOT = Path(__file__).resolve().parents[1]
QUIET = ("-p", "no:run-parallel", "-p", "no:hypothesispytest")


def runner_for(suite: Path, raw: Path, executor: LocalExecutor) -> Runner:
    options = SweepOptions(paths=(suite,), out=raw.parent, seed=1, timeout=60,
                           invoked_from=suite, pytest_args=QUIET, progress=False)  # fmt: skip
    runner = Runner(options, raw, executor=executor)
    return runner


def replay_once(runner: Runner, label: str, nodeid: str) -> float:
    """Seconds one single-test replay takes, start to rows read."""
    replay_file = runner.raw / "replays" / f"{label}.txt"
    order.write_replay(replay_file, [nodeid])
    cmd = runner.pytest_command(runner.replay_targets([nodeid]), runner.raw / label, label,
                                seed=1, workers=0, replay_file=replay_file)  # fmt: skip
    start = time.perf_counter()
    result = runner.run(label, cmd)
    if not result.rows:
        raise SystemExit(f"{label}: no records (see {result.log})")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, default=ROOT / "repro" / "suites" / "polluter")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    suite = args.suite.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fresh = runner_for(suite, work / "fresh" / "raw", LocalExecutor())
        nodeids = [n for n in fresh.collect().nodeids if "::" in n]
        forks = ForkExecutor(fresh.targets(), work / "servers", start_timeout=600)
        forked = runner_for(suite, work / "forked" / "raw", forks)
        forked.rootdir, forked.inifile = fresh.rootdir, fresh.inifile
        times: dict[str, list[float]] = {"fresh": [], "forked": []}
        start_server = time.perf_counter()
        replay_once(forked, "warm-0", nodeids[0])  # starts the server: counted below
        server_s = time.perf_counter() - start_server
        try:
            for k in range(args.replays):
                nodeid = nodeids[k % len(nodeids)]
                sides = [("fresh", fresh), ("forked", forked)]
                for side, runner in sides if k % 2 == 0 else sides[::-1]:
                    times[side].append(replay_once(runner, f"alone-{k + 1}", nodeid))
        finally:
            forks.close()
    if forks.fresh or not forks.forked:
        sys.exit(f"the fork server did not serve every replay: {forks.notes()}")
    total_fresh = sum(times["fresh"])
    total_forked = server_s + sum(times["forked"])
    print(f"suite {suite.name}: {args.replays} single-test replays each way")
    print(f"fresh:  {total_fresh:7.2f} s total, median {statistics.median(times['fresh']):.3f} s")
    print(f"forked: {total_forked:7.2f} s total (server start and first replay "
          f"{server_s:.2f} s), median {statistics.median(times['forked']):.3f} s")  # fmt: skip
    print(f"ratio fresh/forked: {total_fresh / total_forked:.2f}x")


if __name__ == "__main__":
    main()
