"""The journal of a sweep's replays: what --resume keeps of the work after the suite runs.

Every replay process (alone reruns, search and trial replays, screens, verifications,
capture reruns) that finishes gets one line in raw/journal.jsonl, written as it ends:
the question it answered (kind, seed, extra options, whether it ran alone, the sequence)
and how its process ended. Its records stay in raw/<label>. A resumed sweep rebuilds the
same evidence from the same suite runs and so asks the same questions: the n-th asking of
a question answered n times before is served from those records instead of being run
again (issue 24). Questions asked only after the interrupt, and the processes the
interrupt cut off, run. Pair runs (two processes started together) are not journaled:
one half served from the journal would no longer run beside the other.

The fixing phase's work is journaled whole instead (`add_result`): a cleaner search or a
patch search, once finished, is one line with what it found, served to a resumed sweep
as it is (its replays in scratch copies of the suite cannot be asked again).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..records import load_records
from ..verdicts import fold
from .runner import ProcessResult

JOURNAL_FILE = "journal.jsonl"


def question(
    kind: str, seed: int | None, extra: Sequence[str], exclusive: bool, sequence: Sequence[str]
) -> str:
    """A replay's question as one key: the same key asks the same thing of the suite."""
    text = json.dumps([kind, seed, list(extra), exclusive, list(sequence)])
    return hashlib.sha256(text.encode()).hexdigest()


class Journal:
    """raw/journal.jsonl: the finished replays of this sweep (and, resumed, of the one
    before, served in place of running them again)."""

    def __init__(self, raw: Path, *, resume: bool) -> None:
        self.path = raw / JOURNAL_FILE
        self._lock = threading.Lock()
        self._before: dict[str, list[dict[str, Any]]] = {}  # key -> finished, in order
        self._asked: dict[str, int] = {}
        self._results: dict[tuple[str, str], Any] = {}  # (kind, subject) -> what it found
        self.served = 0
        if resume and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    if "result" in entry:
                        self._results[str(entry["result"]), str(entry["subject"])] = entry["data"]
                        continue
                    self._before.setdefault(str(entry["key"]), []).append(entry)
                except (ValueError, KeyError, TypeError):
                    continue  # a line the interrupt cut short
        elif not resume:
            self.path.unlink(missing_ok=True)

    def labels(self) -> set[str]:
        """The processes the journal serves: their records must be kept."""
        return {str(e["label"]) for entries in self._before.values() for e in entries}

    def highest_label(self) -> int:
        """The largest label number it holds ("alone-12": 12), for new labels to follow."""
        numbers = [label.rsplit("-", 1)[-1] for label in self.labels()]
        return max((int(n) for n in numbers if n.isdigit()), default=0)

    def answer(self, key: str, raw: Path) -> ProcessResult | None:
        """The finished process that answered this asking of `key` before, or None."""
        with self._lock:
            n = self._asked.get(key, 0)
            self._asked[key] = n + 1
            before = self._before.get(key, [])
            if n >= len(before):
                return None
            self.served += 1
        entry = before[n]
        label = str(entry["label"])
        rows, malformed = load_records(raw / label)
        end = fold.RunOutcome(
            label, int(entry["returncode"]), stalled_after=entry.get("stalled_after"),
            lost=str(entry.get("lost", "")), gpu=str(entry.get("gpu", "")),
            killed=tuple(fold.Killed(*k) for k in entry.get("killed", ())),
        )  # fmt: skip
        return ProcessResult(label, rows, end, raw / f"{label}.log", malformed)

    def add(self, key: str, result: ProcessResult) -> None:
        """Record a finished replay, at once (an interrupt may come next)."""
        end = result.end
        entry = {
            "key": key, "label": result.label, "returncode": end.returncode,
            "stalled_after": end.stalled_after, "lost": end.lost, "gpu": end.gpu,
            "killed": [[k.nodeid, k.phase, k.index, k.at] for k in end.killed],
        }  # fmt: skip
        line = json.dumps(entry) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line)

    def result(self, kind: str, subject: str) -> tuple[bool, Any]:
        """(found?, what it found) of a finished `kind` search for `subject` before."""
        with self._lock:
            if (kind, subject) not in self._results:
                return False, None
            self.served += 1
            return True, self._results[kind, subject]

    def add_result(self, kind: str, subject: str, data: Any) -> None:
        """Record a finished `kind` search for `subject` (JSON-able `data`), at once."""
        line = json.dumps({"result": kind, "subject": subject, "data": data}) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line)
