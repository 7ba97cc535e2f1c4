"""`capsafe sweep`: the command line over harness.sweep.run.

Arguments after `--` go to every pytest process untouched. argparse itself
cannot tell them apart from paths (it drops the `--` and merges both into one
list), so the sweep's parser splits them off before parsing.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import os
import random
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from ..plugin import gpus
from ..report import placement
from ..verdicts import catalogue
from ..verdicts.evidence import VERIFY_TIMES
from . import capture_sweep, config, console, run, state, termination
from .executors import EXECUTORS, make_executor
from .options import SweepError, SweepOptions
from .ray_executor import NOT_INSTALLED
from .shard import parse_shard

EPILOG = """\
exit codes:
  0    every test is pass, or listed in the --baseline quarantine file
  1    some test is not pass (and not quarantined); a collection error counts, and
       so does a suite run pytest failed with every test passing (a raising
       session hook, a hang after the last test, --cov-fail-under)
  2    usage error: bad option, missing path or plugin, unwritable --out or one
       holding a sweep, a suite that cannot run or of which nothing was collected
{interrupted}

classifications (the first whose evidence holds; causes verified {k} times each way):
{classes}

example (nightly):
  capsafe sweep tests --runs 10 --workers 8 --out reports/$(date +%F-%H%M) \\
      --baseline quarantine.txt --budget 3600 -- -m "not slow"
"""


def _epilog() -> str:
    classes = "\n".join(catalogue.help_lines())
    return EPILOG.format(k=VERIFY_TIMES, classes=classes, interrupted=termination.EXIT_CODE_HELP)


class _SweepHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's usage line, ending in the `-- PYTEST_ARGS` that _SweepParser splits off."""

    def _format_usage(self, *args: Any, **kwargs: Any) -> str:
        usage = super()._format_usage(*args, **kwargs)
        body = usage.rstrip("\n")
        return f"{body} [-- PYTEST_ARGS ...]" + usage[len(body) :]


class _SweepParser(argparse.ArgumentParser):
    """Splits everything after the first `--` into `pytest_args`, and takes its defaults
    from the project's `[tool.capsafe]` (harness.sweep.config) before parsing, so a flag
    given overrides them. A bad table is kept for `main` to report in one line. Answers
    an unknown option itself: handed back to the top-level parser, it printed `capsafe`'s
    usage."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        passthrough: list[str] | None = None
        if "--" in given:
            cut = given.index("--")
            given, passthrough = given[:cut], given[cut + 1 :]
        found, problem = config.SweepConfig(), ""
        try:
            found = config.load(self, Path.cwd())
        except SweepError as exc:
            problem = str(exc)
        self.set_defaults(**found.defaults)
        parsed, unknown = super().parse_known_args(given, namespace)
        if unknown:
            self.error(_unrecognized(self, unknown))
        if passthrough is None:
            passthrough = list(found.defaults.get("pytest_args", []))
        parsed.pytest_args = passthrough
        parsed.config, parsed.config_problem = found, problem
        return parsed, unknown


def _unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's message, with the closest option when one is near (`--run` -> `--runs`)."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    first = unknown[0].split("=", 1)[0]
    known = [o for action in parser._actions for o in action.option_strings]
    close = difflib.get_close_matches(first, known, n=1) if first.startswith("-") else []
    if close:
        message += f" (did you mean {close[0]}?)"
    if not first.startswith("-"):
        message += " (options for pytest go after --)"
    return message


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="run a pytest suite many ways and classify every test",
        description=(
            "Run a pytest suite N times in shuffled, reproducible orders under xdist, rerun "
            "every failing test alone, find the polluter of each order-dependent test and the "
            "state-setter of each brittle one, and write records.jsonl, tests.csv, "
            "summary.json, report.md and report.html into --out (history.csv and `latest` "
            "beside it)."
        ),
        epilog=_epilog(),
        formatter_class=_SweepHelpFormatter,
    )
    parser.__class__ = _SweepParser  # add_parser takes no parser class of its own
    parser.add_argument(
        "paths", nargs="*", metavar="PATH",
        help="test files or directories (default: the suite's testpaths, from the current "
        "directory); pytest runs in their common parent, so the suite's own ini applies",
    )  # fmt: skip
    parser.add_argument(
        "--runs",
        type=int,
        default=5,
        metavar="N",
        help="whole-suite runs, each with its own order seed (default 5)",
    )
    parser.add_argument(
        "--workers", type=int, default=min(4, os.cpu_count() or 1), metavar="W",
        help="xdist workers per run, and parallel reruns; 0 runs without xdist "
        "(default: min(4, CPUs))",
    )  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=None, metavar="J",
        help="test processes the reruns, searches and screens run at once (default: W, or "
        "half the CPUs where that is more, at most 8; W with --neighbors; with --workers 0, "
        "min(4, CPUs))",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="sweep seed; every run's order seed derives from it "
                        "(default: random, printed)")  # fmt: skip
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="report directory (default: reports/<timestamp>)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SEC",
        help="per-test timeout through pytest-timeout (default 60)",
    )
    parser.add_argument(
        "--isolation-runs",
        type=int,
        default=3,
        metavar="R",
        help="fresh-process reruns of every test that failed (default 3)",
    )
    parser.add_argument("--neighbors", type=int, default=0, metavar="K",
                        help="capsafe neighbour threads per test process issuing "
                        "capture-breaking calls (default 0)")  # fmt: skip
    parser.add_argument("--protect", default=capture_sweep.AUTO, metavar="auto|none|NAME,...",
                        help="rerun each capture-unsafe test with --capsafe-protect=NAMES beside "
                        "the neighbours; auto: the integrations (cupy, cuda_core, torch) of the "
                        "frameworks those tests captured through, else of every framework the "
                        "suite's interpreter finds (default auto)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="run each test body in T threads at once, through "
                        "pytest-run-parallel (default 1)")  # fmt: skip
    add_verdict_options(parser)
    parser.add_argument("--fix", action="store_true",
                        help="after the searches, find each order-dependent test's cleaners and "
                        "a patch for every order-dependent and brittle test, verified by replay "
                        "in a scratch copy of the suite, into --out/fixes (`capsafe fix OUT` "
                        "applies them); a phase of its own, with its own "
                        "--phase-budget")  # fmt: skip
    parser.add_argument("--phase-budget", default="auto", metavar="SEC|auto|none",
                        help="seconds each phase after the suite runs (isolation, searches, "
                        "fixes) may "
                        "take; what it leaves undone is unverified, never pass (default auto: "
                        "10x the suite runs' time, at least 10 minutes)")  # fmt: skip
    again = parser.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep in --out (its seed; the same options)",
    )
    again.add_argument(
        "--force",
        action="store_true",
        help="start over in an --out that holds a sweep (its files are removed)",
    )
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="do shard K of N (a CI matrix job): runs K, K+N, ... and the alone "
                        "reruns of its share of the failing tests, no searches; needs --seed; "
                        "`capsafe merge` combines the shards' --out")  # fmt: skip
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="where the pytest processes run: local subprocesses (default), or ray: each one "
        "a Ray task (needs capsafe[ray]; every node needs this checkout and Python at the same "
        "paths, or a shared filesystem)",
    )
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="start every suite run (under xdist), rerun, replay, screen and pair run in "
        "new interpreters (the reference path, and slower); by default they are forked from "
        "one pytest that collected the suite once (a suite run as a child per xdist worker, "
        "once the first run under xdist matched their plan), and run fresh only where it "
        "cannot fork (the report says why)",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="--executor ray: the cluster, auto, HOST:PORT or ray://HOST:PORT (default: start "
        "or join a local Ray instance)",
    )
    parser.add_argument(
        "--gpus",
        default=None,
        metavar="all|N|ID,ID...",
        help="pin each xdist worker, rerun and replay to one GPU through CUDA_VISIBLE_DEVICES, "
        "round-robin (all: every GPU nvidia-smi -L or CUDA_VISIBLE_DEVICES shows; N: the first "
        "N; ids (one: `2,`): as given, even where no GPU is found); each row records its `gpu`, "
        "the report groups failures by GPU; with ray each task asks for one GPU",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=main, pytest_args=[], config=config.SweepConfig(), config_problem="")


def main(args: argparse.Namespace) -> int:
    if args.config_problem:
        return _usage(args.config_problem)
    try:
        options = options_from(args)
    except SweepError as exc:
        return _usage(str(exc))
    from_file = args.config.line()
    print(
        f"capsafe sweep: seed={options.seed} runs={options.runs} workers={options.workers} "
        f"out={options.out}" + (f" {from_file}" if from_file else ""),
        file=sys.stderr,
    )
    try:
        with termination.stop_signals_interrupt():
            result = run.run_sweep(options)
    except SweepError as exc:
        return _usage(str(exc))
    except KeyboardInterrupt:  # a second Ctrl-C, while the partial report was being written
        print(f"capsafe sweep: interrupted; the report in {options.out} may be incomplete",
              file=sys.stderr)  # fmt: skip
        return run.EXIT_INTERRUPTED
    lines = console.console_lines(result)
    if by_gpu := placement.console_line(result.summary.placement):
        lines.insert(-1, by_gpu)
    for line in lines:
        print(f"capsafe sweep: {line}" if line == result.reason else line, file=sys.stderr)
    return result.exit_code


def options_from(args: argparse.Namespace) -> SweepOptions:
    """Validated SweepOptions; SweepError with a one-line reason for anything wrong."""
    paths = []
    for raw in args.paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise SweepError(_missing_path(raw))
        paths.append(path.resolve())
    for name, value, low in (
        ("--runs", args.runs, 1),
        ("--workers", args.workers, 0),
        ("--jobs", 1 if args.jobs is None else args.jobs, 1),
        ("--isolation-runs", args.isolation_runs, 1),
        ("--neighbors", args.neighbors, 0),
        ("--threads", args.threads, 1),
    ):
        if value < low:
            raise SweepError(f"{name} must be at least {low}, got {value}")
    if not 0 < args.timeout < math.inf:
        raise SweepError(f"--timeout must be positive and finite, got {args.timeout:g}")
    budget, baseline = verdict_options(args)
    for needed, module, package, why, extra in (
        (args.workers > 0, "xdist", "pytest-xdist", "--workers > 0; or use --workers 0",
         "harness"),
        (args.threads > 1, "pytest_run_parallel", "pytest-run-parallel", "--threads > 1",
         "threads"),
        (True, "pytest_timeout", "pytest-timeout", "per-test timeouts", "harness"),
    ):  # fmt: skip
        if needed and importlib.util.find_spec(module) is None:
            raise SweepError(
                f"{package} is not installed (needed for {why}): install capsafe's "
                f"{extra} extra (pip install -e '.[{extra}]' in a checkout)"
            )
    out = args.out if args.out is not None else _default_out()
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out} exists and is not a directory")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    if args.resume and args.seed is None and (out / state.STATE_FILE).is_file():
        seed = int(state.resumed_options(out)["seed"])
    if seed < 0:
        raise SweepError(f"--seed must be a non-negative integer, got {seed}")
    shard = None
    if args.shard is not None:
        try:
            shard = parse_shard(args.shard)
        except ValueError as exc:
            raise SweepError(str(exc)) from None
        if args.seed is None and not args.resume:
            raise SweepError("--shard needs --seed S: every shard of a sweep has its seed")
        if shard.count > args.runs:
            raise SweepError(f"--shard {shard} with --runs {args.runs}: a shard does whole "
                                   "runs, so N must be at most --runs")  # fmt: skip
    if args.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise SweepError(NOT_INSTALLED)
    if args.address is not None and args.executor != "ray":
        raise SweepError("--address needs --executor ray")
    try:
        devices = gpus.parse(args.gpus) if args.gpus is not None else ()
    except gpus.GpuError as exc:
        raise SweepError(f"--gpus {exc}") from None
    if args.executor != "local":  # connect now: an unreachable cluster is a usage error
        make_executor(args.executor, args.address, gpus=bool(devices))
    state.prepare_out(out, resume=args.resume, force=args.force)
    options = SweepOptions(
        paths=tuple(paths),
        out=out.resolve(),
        seed=seed,
        runs=args.runs,
        workers=args.workers,
        jobs=args.jobs,
        timeout=args.timeout,
        isolation_runs=args.isolation_runs,
        neighbors=args.neighbors,
        threads=args.threads,
        budget=budget,
        phase_budget=phase_budget_option(args.phase_budget),
        baseline=baseline,
        pytest_args=tuple(args.pytest_args),
        progress=not args.no_progress,
        invoked_from=Path.cwd(),
        resume=args.resume,
        force=args.force,
        protect=capture_sweep.protect_choice(args.protect),
        shard=shard,
        executor=args.executor,
        fork=not args.fresh_processes,
        address=args.address,
        gpus=devices,
        junitxml=junit_path(args),
        fix=args.fix,
    )
    if args.resume:
        before = state.resumed_options(out)
        differ = [k for k, v in options.identity().items() if before.get(k) != v]
        if differ:
            name = differ[0]
            raise SweepError(
                f"--resume: {name} is {options.identity()[name]!r} here but "
                f"{before.get(name)!r} in the sweep in {out}; give the same options"
            )
    return options


def add_verdict_options(parser: argparse.ArgumentParser) -> None:
    """--budget, --baseline and --junitxml, which `capsafe sweep` and `capsafe merge` share."""
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SEC",
        help="stop starting new work after SEC seconds and report what ran",
    )
    parser.add_argument("--baseline", type=Path, default=None, metavar="FILE",
                        help="quarantine file: node ids (one per line, # comments) that do "
                        "not fail the verdict")  # fmt: skip
    parser.add_argument(
        "--junitxml",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the verdicts as JUnit XML: one testcase per test, a failure (its "
        "class and cause) for each that is not pass. Under GitHub Actions (GITHUB_ACTIONS="
        "true) an annotation per such test is printed and report.md appended to the job "
        "summary, with or without this option",
    )


def phase_budget_option(text: str) -> float | None:
    """--phase-budget: seconds (inf for none), or None for auto; SweepError otherwise."""
    if text == "auto":
        return None
    if text == "none":
        return math.inf
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:
        raise SweepError(f"--phase-budget must be positive seconds, auto or none, got {text!r}")
    return seconds


def verdict_options(args: argparse.Namespace) -> tuple[float | None, frozenset[str]]:
    """--budget checked and the --baseline file read; SweepError with the reason."""
    if args.budget is not None and not args.budget > 0:
        raise SweepError(f"--budget must be positive, got {args.budget:g}")
    if args.junitxml is not None and args.junitxml.is_dir():
        raise SweepError(f"--junitxml {args.junitxml} is a directory; give a file")
    if args.baseline is None:
        return args.budget, frozenset()
    try:
        return args.budget, state.read_baseline(args.baseline)
    except (OSError, UnicodeDecodeError) as exc:
        reason = state.describe_error(exc)
        raise SweepError(f"cannot read --baseline {args.baseline}: {reason}") from None


def _missing_path(raw: str) -> str:
    """The reason a PATH argument does not exist; a node id (`file.py::test`) is told so."""
    file, sep, name = raw.partition("::")
    if sep and Path(file).expanduser().is_file():
        return (
            f"{raw} is a test id; the sweep takes files and directories (give {file}, "
            f"and -- -k {name.split('[')[0].split('::')[-1]} to select within it)"
        )
    return f"no such file or directory: {raw}"


def junit_path(args: argparse.Namespace) -> Path | None:
    """--junitxml, absolute (the test processes run elsewhere; the file is the caller's)."""
    return None if args.junitxml is None else Path(args.junitxml).resolve()


def _default_out() -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path("reports") / stamp
    n = 1
    while out.exists():
        n += 1
        out = Path("reports") / f"{stamp}-{n}"
    return out


def _usage(reason: str) -> int:
    print(f"capsafe sweep: {reason}", file=sys.stderr)
    return run.EXIT_USAGE
