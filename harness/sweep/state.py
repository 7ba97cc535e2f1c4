"""A sweep's --out: what it writes there, sweep.json (what --resume and `capsafe merge` read
besides the records), and the checks made before anything runs."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..plugin import order
from .options import SweepError

STATE_FILE = "sweep.json"
SWEEP_FILES = (STATE_FILE, "raw", "replays", "records.jsonl", "tests.csv", "summary.json",
               "report.md", "report.html")  # fmt: skip
"""What a sweep writes into --out: all that --force removes."""


def read_baseline(path: str | os.PathLike[str]) -> frozenset[str]:
    """Quarantined node ids: a replay-style list whose lines may also end in ' # comment'."""
    ids = (line.split(" #", 1)[0].strip() for line in order.read_replay(path))
    return frozenset(nodeid for nodeid in ids if nodeid)


def describe_error(exc: BaseException) -> str:
    """The reason alone ("Permission denied"), for a one-line message that names the path."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def holds_sweep(out: Path) -> bool:
    return out.is_dir() and any((out / name).exists() for name in SWEEP_FILES)


def prepare_out(out: Path, *, resume: bool = False, force: bool = False) -> None:
    """Create the report directory and prove it writable now, not after an hour of runs.
    An --out that holds a sweep is refused unless resuming it or starting over (--force,
    which removes only what a sweep writes). SweepError with the reason otherwise."""
    if holds_sweep(out) and not (resume or force):
        raise SweepError(f"--out {out} holds a sweep already: --resume to continue it, "
                         "--force to start over, or another --out")  # fmt: skip
    if resume and not (out / STATE_FILE).is_file():
        raise SweepError(f"--resume: --out {out} holds no sweep to continue")
    try:
        if force and not resume:
            for name in SWEEP_FILES:
                target = out / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise SweepError(f"cannot write reports into --out {out}: {describe_error(exc)}") from None


def read_state(out: Path) -> dict[str, Any]:
    """sweep.json of the sweep in `out` (OSError, ValueError when unreadable)."""
    state = json.loads((out / STATE_FILE).read_text(encoding="utf-8"))
    if not isinstance(state, dict):
        raise ValueError("not a JSON object")
    return state


def resumed_options(out: Path) -> dict[str, Any]:
    """The options the sweep in `out` ran with (for --resume to check against)."""
    return dict(read_state(out)["options"])
