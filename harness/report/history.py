"""Sweep-over-sweep memory: history.csv beside the report directories, and `latest`.

One row per test per sweep, keyed by suite: sibling projects whose sweeps share
a reports directory share the file, never a trend. `first_seen` / `last_seen`
are the timestamps of the first and the latest sweep of that suite in which the
test was not `pass`, carried forward on every row, so the newest row alone
answers "since when, and is it still happening?" the way a hosted flake tracker
would. The file handling (lock, torn rows, the older format without `suite`) is
here; the aggregation is pandas, in harness.report.tables.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from . import tables

HISTORY_FILE = "history.csv"
LATEST = "latest"
COLUMNS = tables.HISTORY_COLUMNS
OLDER_COLUMNS = COLUMNS[1:]  # before `suite`: such a file is rewritten with suite ""


@dataclass(frozen=True)
class Verdict:
    """What one sweep concluded about one test: the input to a history row."""

    nodeid: str
    classification: str
    runs: int
    failures: int
    flake_rate: float


class HistoryError(ValueError):
    """history.csv exists but cannot be read or appended to as a history file."""


def read_history(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Every complete row of a history file (none when it does not exist yet).

    A row cut short (a writer killed mid-line) is dropped; a file that is not
    UTF-8 CSV raises HistoryError.
    """
    path = Path(path)
    if not path.exists():
        return []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise HistoryError(f"{path} is not a history file: {exc}") from None
    return [row for row in rows if None not in row.values()]


def suite_key(paths: Iterable[str | os.PathLike[str]]) -> str:
    """What names a suite in history.csv: the absolute paths it was swept with."""
    return " ".join(sorted(str(Path(p).resolve()) for p in paths))


def append_history(
    path: str | os.PathLike[str],
    sweep_id: str,
    timestamp: str,
    verdicts: Iterable[Verdict],
    *,
    suite: str,
) -> list[dict[str, str]]:
    """Append this sweep's rows (under a file lock: two sweeps may share a reports dir).

    Returns this suite's history including the new rows. HistoryError, with the
    file untouched, when it exists and is not a history file (see `set_aside`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{path.name}.lock")):
        old = read_history(path)
        header = _header(path)
        if header == list(OLDER_COLUMNS):
            _rewrite(path, old)
            header = list(COLUMNS)
        elif header is not None and header != list(COLUMNS):
            raise HistoryError(f"{path} has columns {','.join(header)}, not {','.join(COLUMNS)}")
        new = tables.new_history_rows(old, suite, sweep_id, timestamp, verdicts)
        with open(path, "a", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            if header is None:
                writer.writeheader()
            elif not _ends_with_newline(path):
                f.write("\n")  # a row cut short by a killed writer stays on its own line
            writer.writerows(new)
    return tables.of_suite(old + new, suite)


def _rewrite(path: Path, rows: list[dict[str, str]]) -> None:
    """Rewrite a file of the older format with the `suite` column (empty: suite unknown)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    with open(staging, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({"suite": "", **row} for row in rows)
    os.replace(staging, path)


def _header(path: Path) -> list[str] | None:
    """The column names of an existing, non-empty file (None when there is none yet)."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, newline="", encoding="utf-8") as f:
        return next(csv.reader(f), [])


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def set_aside(path: str | os.PathLike[str]) -> Path:
    """Rename an unusable history file out of the way (kept, never deleted); its new name."""
    path = Path(path)
    stem = f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = path.with_name(stem), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{stem}-{n}")
    path.rename(aside)
    return aside


def point_latest(out: str | os.PathLike[str]) -> Path:
    """Make `<parent of out>/latest` name `out`: a relative symlink, else a text file.

    A real directory already called `latest` is someone's data: FileExistsError, untouched.
    """
    out = Path(out).resolve()
    latest = out.parent / LATEST
    if latest.is_dir() and not latest.is_symlink():
        raise FileExistsError(f"{latest} is a directory; not replacing it")
    staging = out.parent / f".{LATEST}.{os.getpid()}"
    try:
        staging.unlink(missing_ok=True)
        os.symlink(out.name, staging, target_is_directory=True)
        os.replace(staging, latest)
    except OSError:
        staging.unlink(missing_ok=True)
        if latest.is_symlink() or latest.is_file():
            latest.unlink()
        latest.write_text(f"{out}\n", encoding="utf-8")
    return latest
