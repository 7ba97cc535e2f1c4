"""The record format: one JSON object per test per phase, shared by the plugin and the sweep.

Each test process appends to its own file, `records-<run_id>-<worker>-<pid>.jsonl`,
and flushes after every line, so a worker that dies mid-test loses at most the
line it was writing. The reader therefore skips malformed or truncated lines
(counting them) instead of failing the whole sweep over one half-written row.

This module is imported by the plugin in every test process: stdlib only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Literal, NotRequired, TypedDict

log = logging.getLogger("capsafe.harness")

PHASES = ("setup", "call", "teardown")
OUTCOMES = ("passed", "failed", "skipped")
SIGNALS = ("capture-invalidated", "frozen-config", "env-leak", "timeout", "crash")
MESSAGE_LIMIT = 500
FILE_GLOB = "records-*.jsonl"

Phase = Literal["setup", "call", "teardown"]
Outcome = Literal["passed", "failed", "skipped"]


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
    env_leak: NotRequired[dict[str, list[str | None]]]  # only with the "env-leak" signal
    message: str  # first MESSAGE_LIMIT characters of the failure, "" when it passed
    time: float  # unix time the row was written


_REQUIRED = tuple(k for k in Record.__annotations__ if k != "env_leak")


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
    return row  # type: ignore[return-value]


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
