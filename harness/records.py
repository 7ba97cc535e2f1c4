"""The record format: one JSON object per test per phase, shared by the plugin and the sweep.

Each test process appends to its own file, `records-<run_id>-<worker>-<pid>.jsonl`,
and flushes after every line, so a worker that dies mid-test loses at most the
line it was writing. The reader therefore skips malformed or truncated lines
(counting them) instead of failing the whole sweep over one half-written row.

Readers are tolerant of older files: a row written before a field existed gets
that field's default when read (`from_json`), so every consumer can rely on
every field of `Record`.

This module is imported by the plugin in every test process: stdlib only.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import IO, Literal, NotRequired, TypedDict

log = logging.getLogger("capsafe.harness")

PHASES = ("setup", "call", "teardown")


class Signal(StrEnum):
    """Every signal a record can carry (written and compared as its string)."""

    CAPTURE_INVALIDATED = "capture-invalidated"  # the failure text names a capture error
    FROZEN_CONFIG = "frozen-config"  # capsafe's frozen configuration was changed
    ENV_LEAK = "env-leak"  # a watched environment variable was left changed
    TIMEOUT = "timeout"  # pytest-timeout, or the sweep's watchdog, stopped the test
    CRASH = "crash"  # the test's process died while it ran
    FAILED_IN_CAPTURE = "failed-in-capture"  # raised inside a capture window the test began


MESSAGE_LINES = 5  # `message`: the first lines of the failure ...
MESSAGE_LIMIT = 500  # ... and at most this many characters of them
DETAILS_LIMIT = 8000  # `details`: the whole report text, its last characters when longer
FILE_GLOB = "records-*.jsonl"

Phase = Literal["setup", "call", "teardown"]
Outcome = Literal["passed", "failed", "skipped", "xfailed", "xpassed"]
OUTCOMES: tuple[Outcome, ...] = ("failed", "xpassed", "xfailed", "skipped", "passed")
"""Every phase outcome; the first present decides a test's outcome (see `fold_outcome`)."""


class Capture(TypedDict):
    """One capture a test began (any phase), as its teardown row's `captures` holds it."""

    framework: str  # the hook point (capsafe.integrations.observe.POINTS) that saw it
    stream: str
    mode: str
    site: str  # file:line of the test code that began it
    open: bool  # still open when the test ended


class Record(TypedDict):
    """One phase report of one test, as the plugin writes it."""

    nodeid: str
    phase: Phase
    outcome: Outcome
    duration: float
    run_id: str
    seed: int | None
    worker: str  # "gw0", "gw1", ... or "main" when not under xdist
    index: int  # 0-based position of the test in its process's sequence
    pid: int
    signals: list[str]
    env_leak: NotRequired[dict[str, list[str | None]]]  # only with Signal.ENV_LEAK
    captures: NotRequired[list[Capture]]  # teardown rows of tests that began a capture
    thread_unsafe: NotRequired[str]  # teardown rows of tests pytest-run-parallel marks so: why
    message: str  # first lines of the failure or skip reason, "" when it passed
    details: str  # the full report text (traceback), bounded; "" when it passed
    start: float  # unix time the phase started ...
    stop: float  # ... and ended: tells which tests ran at the same time in other workers
    time: float  # unix time the row was written
    gpu: str  # the one device the process was pinned to (CUDA_VISIBLE_DEVICES), "" if not


_ADDED = ("details", "start", "stop", "gpu")
"""Fields newer than the first record format: filled in by `from_json` for older rows."""
_OPTIONAL = ("env_leak", "captures", "thread_unsafe")
_REQUIRED = tuple(k for k in Record.__annotations__ if k not in _OPTIONAL and k not in _ADDED)


_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def to_json(record: Record) -> str:
    """One line of JSON (no newline) for `record`."""
    return _encode(record)


def from_json(line: str) -> Record:
    """Parse one line; ValueError when it is not a complete record."""
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError("record is not a JSON object")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ValueError(f"record lacks {', '.join(missing)}")
    if row["phase"] not in PHASES:
        raise ValueError(f"record has unknown phase {row['phase']!r}")
    if row["outcome"] not in OUTCOMES:
        raise ValueError(f"record has unknown outcome {row['outcome']!r}")
    row.setdefault("details", row["message"])
    row.setdefault("stop", row["time"])
    row.setdefault("start", row["stop"] - row["duration"])
    row.setdefault("gpu", "")
    return row  # type: ignore[return-value]


def first_lines(text: str) -> str:
    """The head of a failure for a table cell: MESSAGE_LINES lines, MESSAGE_LIMIT characters."""
    head = "\n".join(text.strip("\n").splitlines()[:MESSAGE_LINES])
    return head if len(head) <= MESSAGE_LIMIT else head[: MESSAGE_LIMIT - 1] + "…"


def bounded_details(text: str) -> str:
    """The full report text, or its last DETAILS_LIMIT characters (where the error is)."""
    return text if len(text) <= DETAILS_LIMIT else "…" + text[-(DETAILS_LIMIT - 1) :]


def fold_outcome(outcomes: Iterable[str]) -> Outcome:
    """One test's outcome from its phases' outcomes: the first of OUTCOMES among them.

    A failure in any phase fails the test; an xfail/skip in setup or call is the
    test's outcome even though its teardown passed; "passed" only when nothing else.
    """
    seen = set(outcomes)
    for outcome in OUTCOMES:
        if outcome in seen:
            return outcome
    return "passed"


def records_path(directory: str | os.PathLike[str], run_id: str, worker: str, pid: int) -> Path:
    """Where one process writes its rows."""
    return Path(directory) / f"records-{run_id}-{worker}-{pid}.jsonl"


class RecordWriter:
    """Append-only, line-buffered writer of one process's records file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered binary append: each row is one write() call, so it reaches the file
        # before the next test starts, and rows of a dying process are never half-buffered.
        self._file: IO[bytes] | None = open(self.path, "ab", buffering=0)  # noqa: SIM115

    def write(self, record: Record) -> None:
        if self._file is None:
            raise ValueError(f"records file {self.path} is closed")
        self._file.write((to_json(record) + "\n").encode("utf-8"))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _record_files(source: Path) -> list[Path]:
    if source.is_dir():
        return sorted(source.glob(FILE_GLOB))
    return [source] if source.exists() else []


def load_records(source: str | os.PathLike[str]) -> tuple[list[Record], int]:
    """Rows from a records directory (every records-*.jsonl) or one .jsonl file,
    and how many lines were skipped as malformed."""
    rows: list[Record] = []
    skipped = 0
    for path in _record_files(Path(source)):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rows.append(from_json(line))
                except ValueError:
                    skipped += 1
    return rows, skipped


def read_records(source: str | os.PathLike[str]) -> list[Record]:
    """Rows from `source`, skipping malformed lines with one logged warning."""
    rows, skipped = load_records(source)
    if skipped:
        log.warning("skipped %d malformed record line(s) under %s", skipped, source)
    return rows
