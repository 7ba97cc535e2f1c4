"""A real replay for the fix engine's tests: one fresh pytest process per sequence, in the
given root, with nothing of the sweep (the sweep's own replay is Host.replay)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

OUTCOMES = {"PASSED": False, "XFAIL": False, "FAILED": True, "ERROR": True, "XPASS": True}


class Replay:
    """replay(root, sequence) -> node id -> failed?, counting the processes and their roots."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, tuple[str, ...]]] = []

    def __call__(self, root: Path, sequence: Sequence[str]) -> Mapping[str, bool | None]:
        self.calls.append((root, tuple(sequence)))
        cmd = [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
            "-q", "-rA", f"--rootdir={root}", *sequence,
        ]  # fmt: skip
        # No installed plugin (capsafe's, xdist, randomly): a bare pytest starts in a fifth of
        # the time, and the suites under test need none.
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        out: dict[str, bool | None] = dict.fromkeys(sequence)
        for line in done.stdout.splitlines():
            word, _, rest = line.partition(" ")
            if word in OUTCOMES:
                nodeid = rest.split(" - ", 1)[0].strip()
                out[nodeid] = bool(out.get(nodeid)) or OUTCOMES[word]
        if any(out.get(n) is None for n in sequence):
            # As the sweep's replay (--capsafe-replay) does: an id that is not one collected
            # test (pytest would take test_x for all of test_x[1], test_x[2]) refuses the list.
            return dict.fromkeys(sequence)
        return out


def write_suite(root: Path, files: Mapping[str, str]) -> Path:
    """A planted suite: `files` (path -> source) under `root`, with a pytest.ini of its own."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root
