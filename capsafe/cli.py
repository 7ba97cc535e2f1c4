"""The `capsafe` command.

Subcommands live with the code they drive and register themselves through the
`capsafe.commands` entry-point group: `cache` here in the core, `sweep` in the
harness, `repro` in the reproducers. That keeps capsafe free of imports from
harness and repro while one command serves all three. A register function
takes the subparsers object and adds one parser whose `func` default takes the
parsed namespace and returns an exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from capsafe.config import SettingError, check_settings
from capsafe.errors import CapsafeError

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head -1`


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capsafe",
        description="Find and prevent CUDA tests that pass alone and fail together.",
    )
    parser.add_argument("--version", action="version", version=f"capsafe {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for ep in sorted(entry_points(group="capsafe.commands"), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:
            # A missing optional dependency must not take the other commands down.
            missing = commands.add_parser(ep.name, help=f"(unavailable: {exc})")
            missing.set_defaults(func=_unavailable(ep.name, exc))
            continue
        register(commands)
    return parser


def _unavailable(name: str, exc: ImportError) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        print(
            f"capsafe {name}: unavailable ({exc}); install capsafe with its extras: "
            "pip install -e '.[dev]' in a capsafe checkout",
            file=sys.stderr,
        )
        return EXIT_USAGE

    return run


def setting_error_line(exc: SettingError) -> str:
    """The one line every capsafe entry point prints for a bad setting."""
    return f"capsafe: {exc}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("capsafe")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        check_settings()
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except SettingError as exc:
        print(setting_error_line(exc), file=sys.stderr)
        return EXIT_USAGE
    except CapsafeError as exc:
        print(f"capsafe {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"capsafe {args.command}: interrupted", file=sys.stderr)
        return 130


def _reader_gone() -> int:
    """stdout's reader left (`capsafe cache stats | head -1`): stop quietly, as a command
    killed by SIGPIPE does (exit 128 + 13), instead of a BrokenPipeError traceback. stdout
    is pointed at /dev/null so the interpreter's final flush cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
