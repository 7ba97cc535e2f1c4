"""`capsafe repro`: list the reproducers in this package and run one.

Every module directly in `repro/` (except this one and private `_` modules) is
a reproducer runnable as `python -m capsafe_repro.NAME`; the list is discovered, so a
new reproducer shows up without touching this file. `capsafe repro NAME ARGS`
runs it in a fresh interpreter: reproducers set process-wide state (the driver
backend, frozen configuration) that must not leak between them.

The command-line conventions every reproducer shares (`--json PATH`,
`--backend sim|cuda`) live here too, so they read the same everywhere.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from capsafe.cli import setting_error_line
from capsafe.config import SettingError, check_settings
from capsafe.errors import BackendUnavailable, UsageError

EXIT_USAGE = 2
_PACKAGE_DIR = Path(__file__).resolve().parent
SELF = "cli"


def reproducers() -> dict[str, str]:
    """Reproducer module name -> first line of its docstring, sorted by name."""
    found = {}
    for info in pkgutil.iter_modules([str(_PACKAGE_DIR)]):
        if info.ispkg or info.name == SELF or info.name.startswith("_"):
            continue
        found[info.name] = _summary(_PACKAGE_DIR / f"{info.name}.py")
    return dict(sorted(found.items()))


def _summary(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (OSError, SyntaxError, ValueError):
        return ""
    return doc.strip().splitlines()[0] if doc else ""


def register(subparsers: Any) -> None:
    """Add `capsafe repro` to the capsafe command."""
    parser = subparsers.add_parser(
        "repro",
        help="list or run a hazard reproducer",
        description=(
            "Run one reproducer in a fresh Python process, passing the remaining arguments "
            "through (each accepts --json PATH and --backend sim|cuda; see "
            "`capsafe repro NAME --help`). Without NAME, list them."
        ),
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="reproducer to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the reproducer")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    found = reproducers()
    if args.name is None:
        width = max((len(name) for name in found), default=0)
        for name, summary in found.items():
            print(f"{name:<{width}}  {summary}")
        return 0
    name = args.name.removeprefix(f"{__package__}.").removeprefix("repro.").replace("-", "_")
    if name not in found:
        print(
            f"capsafe repro: no reproducer {args.name!r}; choose one of: {', '.join(found)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    command = [sys.executable, "-m", f"{__package__}.{name}", *args.args]
    return subprocess.run(command, check=False).returncode


# -- shared by the reproducers -----------------------------------------------------


def reproducer_parser(module_doc: str | None, module: str | None = None) -> argparse.ArgumentParser:
    """An argument parser with --json and --backend, described by the module docstring;
    `module` (e.g. "capsafe_repro.frozen_config") names the program `python -m module`."""
    doc = (module_doc or "").strip()
    parser = argparse.ArgumentParser(
        prog=None if module is None else f"python -m {module}",
        description=doc.splitlines()[0] if doc else None,
        epilog="\n".join(doc.splitlines()[1:]).strip() or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the result here")
    parser.add_argument(
        "--backend",
        choices=("sim", "cuda"),
        help="driver backend for this run (default: CAPSAFE_BACKEND, else auto)",
    )
    return parser


def run_main(main: Callable[[], int], name: str) -> int:
    """Run a reproducer's main: a bad setting or a missing GPU is one line and exit 2."""
    try:
        check_settings()
        return main()
    except SettingError as exc:
        print(setting_error_line(exc), file=sys.stderr)
        return EXIT_USAGE
    except (UsageError, BackendUnavailable) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def select_backend(name: str | None) -> None:
    """Point this process at a backend before capsafe's configuration freezes.

    Setting the variable is safe only because a reproducer calls this first thing in
    a fresh process, before anything read the configuration.
    """
    if name is not None:
        os.environ["CAPSAFE_BACKEND"] = name


def finish(result: dict[str, Any], json_path: Path | None, ok: bool) -> int:
    """Record the result (with when and where it ran) and turn `ok` into the exit code."""
    result = {
        "ok": ok,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        **result,
    }
    if json_path is not None:
        write_output(json_path, json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {json_path}")
    return 0 if ok else 1


def write_output(path: Path, text: str) -> None:
    """Write a reproducer's --json file; UsageError (one line, exit 2) when it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write --json {path}: {exc.strerror or exc}") from None


def device_facts() -> dict[str, Any]:
    """Backend, device name and driver version of the process-wide device 0."""
    from capsafe import driver
    from capsafe.context import device

    dev = device(0)
    return {
        "backend": driver.backend_choice(),
        "device": dev.name,
        "driver_version": dev.backend.driver_version(),
    }
