"""A second configuration phase in the same process silently runs with the first one's setting.

An application reads MYAPP_KERNEL once, on first use, and keeps it (as most
runtimes do with their environment). A benchmark script then runs two phases in
one process: phase 1 with MYAPP_KERNEL=fast, phase 2 after setting
MYAPP_KERNEL=slow. Phase 2 still runs the fast kernel and nothing says so: its
numbers get attributed to the slow kernel.

1. without the guard: phase 2 reports 'fast';
2. with capsafe's frozen-configuration guard: phase 2 raises FrozenConfigError
   naming MYAPP_KERNEL, both values and where the configuration froze;
3. the remedy, one child process per phase with its environment set before it
   starts: each phase sees its own value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from capsafe.config import Environ, FrozenConfig, FrozenConfigError, runtime_config

from .cli import finish, reproducer_parser, run_main, select_backend

VARIABLE = "MYAPP_KERNEL"
PHASES = ("fast", "slow")
CHILD_FLAG = "--phase-child"


def parse_kernel(env: Environ) -> str:
    return env[VARIABLE] or "fast"


def myapp_config(guard: bool) -> FrozenConfig[str]:
    """The application's configuration, as its own code would declare it."""
    return FrozenConfig("myapp", [VARIABLE], parse_kernel, guard=guard)


def run_phases_in_one_process(guard: bool) -> list[str]:
    """Each phase sets the variable, then asks the configuration which kernel to run."""
    config = myapp_config(guard)
    seen = []
    for value in PHASES:
        os.environ[VARIABLE] = value
        seen.append(config.get())
    return seen


def run_phase_in_child(value: str) -> dict[str, str]:
    env = {**os.environ, VARIABLE: value}
    done = subprocess.run(
        [sys.executable, "-m", "capsafe_repro.frozen_config", CHILD_FLAG],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, str] = json.loads(done.stdout)
    return result


def child_main() -> int:
    """One phase in its own process: report what its configuration froze to."""
    config = myapp_config(guard=True)
    print(json.dumps({"kernel": config.get(), "capsafe_backend": runtime_config().backend}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = reproducer_parser(__doc__, __spec__.name)
    parser.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    select_backend(args.backend)
    if args.phase_child:
        return child_main()
    runtime_config()  # a bad CAPSAFE_ setting fails here, in one line, not in the children
    saved = os.environ.get(VARIABLE)
    try:
        print("1. two phases in one process, guard off:")
        silent = run_phases_in_one_process(guard=False)
        for wanted, got in zip(PHASES, silent, strict=True):
            print(f"   {VARIABLE}={wanted} -> the phase ran kernel {got!r}")
        silent_shown = silent == ["fast", "fast"]
        print(
            "   phase 2 silently ran phase 1's kernel\n"
            if silent_shown
            else "   UNEXPECTED: phase 2 saw its own value\n"
        )

        print("2. the same with the frozen-configuration guard on:")
        try:
            run_phases_in_one_process(guard=True)
            error = None
        except FrozenConfigError as caught:
            error = caught
        if error is None:
            print("   UNEXPECTED: no FrozenConfigError\n")
        else:
            print("   FrozenConfigError: " + str(error).replace("\n", "\n   ") + "\n")
        guard_shown = error is not None and [
            (c.variable, c.frozen, c.current) for c in error.changes
        ] == [(VARIABLE, "fast", "slow")]
    finally:
        if saved is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = saved

    print("3. one child process per phase, environment set before it starts:")
    children = [run_phase_in_child(value) for value in PHASES]
    for wanted, child in zip(PHASES, children, strict=True):
        print(f"   {VARIABLE}={wanted} -> the phase ran kernel {child['kernel']!r}")
    children_shown = [child["kernel"] for child in children] == list(PHASES)

    ok = silent_shown and guard_shown and children_shown
    print("\nverdict: " + ("all three shown" if ok else "NOT SHOWN (see above)"))
    return finish(
        {
            "reproducer": "frozen_config",
            "variable": VARIABLE,
            "phases": list(PHASES),
            "one_process_without_guard": silent,
            "guard_error": None if error is None else str(error),
            "child_per_phase": children,
        },
        args.json,
        ok,
    )


if __name__ == "__main__":
    sys.exit(run_main(main, "capsafe_repro.frozen_config"))
