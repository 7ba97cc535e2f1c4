"""`capsafe merge`: the command line over harness.sweep.merge."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..verdicts.catalogue import Verdict
from . import cli as sweep_cli
from . import console, merge, run, termination
from .options import SweepError

EPILOG = """\
exit codes:
  0    every test is pass, or listed in the --baseline quarantine file
  1    some test is not pass (and not quarantined)
  2    usage error: a DIR that is not a finished shard, shards of different sweeps
       (seed, runs, workers, paths, ... differ), a shard missing or given twice,
       an OUT that is not empty (without --force) or cannot be written
{interrupted}

example (a CI matrix of three jobs, then one merge job):
  capsafe sweep tests --seed 7 --runs 9 --shard 1/3 --out shard-1   # job 1 of 3
  capsafe merge reports/nightly shard-1 shard-2 shard-3
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="combine the --out of `capsafe sweep --shard K/N` runs into one sweep",
        description=(
            "Combine the evidence of every shard of one sweep (`capsafe sweep --shard K/N "
            "--seed S`, same options, each into its own --out): run the alone reruns and "
            "the cause searches that need the combined view, then classify every test as "
            "the unsharded sweep with that seed would, and write one report into OUT "
            "(history.csv and `latest` beside it)."
        ),
        epilog=EPILOG.format(interrupted=termination.EXIT_CODE_HELP),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", type=Path, metavar="OUT", help="report directory of the merge")
    parser.add_argument("shards", type=Path, nargs="+", metavar="DIR",
                        help="the --out of every shard, 1/N to N/N, in any order")  # fmt: skip
    parser.add_argument("--no-run", action="store_true",
                        help="run nothing: a test whose verdict needs a rerun or search is "
                        f"{Verdict.UNVERIFIED}")  # fmt: skip
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into an OUT that is not empty (a sweep there is removed)",
    )
    sweep_cli.add_verdict_options(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        budget, baseline = sweep_cli.verdict_options(args)
        with termination.stop_signals_interrupt():
            result = merge.run_merge(
                args.out, args.shards, no_run=args.no_run, force=args.force, budget=budget,
                baseline=baseline, progress=not args.no_progress,
                junitxml=sweep_cli.junit_path(args),
            )  # fmt: skip
    except SweepError as exc:
        print(f"capsafe merge: {exc}", file=sys.stderr)
        return run.EXIT_USAGE
    except KeyboardInterrupt:  # a second Ctrl-C, while the partial report was being written
        print(f"capsafe merge: interrupted; the report in {args.out} may be incomplete",
              file=sys.stderr)  # fmt: skip
        return run.EXIT_INTERRUPTED
    for line in console.console_lines(result):
        print(f"capsafe merge: {line}" if line == result.reason else line, file=sys.stderr)
    return result.exit_code
