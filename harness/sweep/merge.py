"""`capsafe merge OUT DIR...`: one sweep's verdicts from the evidence of its shards.

Records stay the only interface. Every shard's raw/ (its runs' and alone reruns'
records and logs; shards' labels carry their shard, so they never collide) is copied
into OUT/raw under the same run ids, and the evidence is rebuilt from those rows by
the same code a sweep uses when it resumes. A shard's sweep.json adds only what
records cannot say: the options, the runs done, where pytest ran, each process's exit
code and whether the watchdog killed it, and which alone rerun counts (a rerun
confirmed with no other process alive supersedes the one beside others).

`MergedSweep` loads that in place of the collection and runs phases and then drives
the rest of `Sweep.phases`: the alone reruns no shard did (a test failed in one
shard's runs but hashed to another's bucket), the capture reruns and attribution
(they need every run's evidence), the searches, and the verdicts, report and history
row per test of one sweep. With `--no-run` nothing runs: a test whose verdict needs a
rerun or a search is `unverified`.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plugin.collection import Collected, read_collected
from .bytecode import PYCACHE
from .host import target_outcome
from .journal import JOURNAL_FILE
from .options import SweepError, SweepOptions
from .run import Sweep, SweepResult
from .shard import Shard, parse_shard
from .state import STATE_FILE, describe_error, prepare_out, read_state

NOT_RUN = "`capsafe merge --no-run`: the reruns or searches its verdict needs were not run"
LOCAL = ("shared", "collected.json", "collect.log", "fork-servers", JOURNAL_FILE, PYCACHE)
"""In a shard's raw/ and not evidence to copy (its fork servers' logs, its replay journal,
its processes' bytecode)."""


@dataclass(frozen=True)
class ShardDir:
    """One shard's --out, read and checked: its state and what it collected."""

    path: Path
    shard: Shard
    state: dict[str, Any]
    collected: Collected

    @property
    def identity(self) -> dict[str, Any]:
        """Its options without the shard: what every shard of one sweep shares."""
        return {k: v for k, v in self.state["options"].items() if k != "shard"}


def read_shard(path: Path) -> ShardDir:
    """The shard in `path`; SweepError with a one-line reason when it is not one."""
    if not path.is_dir():
        raise SweepError(f"no such directory: {path}")
    if not (path / STATE_FILE).is_file():
        raise SweepError(f"{path} holds no sweep (no {STATE_FILE})")
    try:
        state = read_state(path)
        spec = state["options"]["shard"]
        shard = parse_shard(spec) if spec is not None else None
        runs = int(state["options"]["runs"])
        done = sorted(int(k) for k in state["runs_done"])
        processes = dict(state["processes"])
        labels = {str(entry[2]) for entry in state["alone"]}
        str(state["invoked_from"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        reason = describe_error(exc)
        raise SweepError(f"{path / STATE_FILE} is not a sweep's state: {reason}") from None
    if shard is None:
        raise SweepError(f"{path} is not a shard (swept without --shard)")
    if done != shard.runs(runs):
        raise SweepError(
            f"{path}: shard {shard} did not finish its runs ({len(done)} of "
            f"{len(shard.runs(runs))} done): `capsafe sweep --resume` it first"
        )
    if not labels <= set(processes) or not {f"run-{k}" for k in done} <= set(processes):
        raise SweepError(f"{path / STATE_FILE} is not a sweep's state: it names processes "
                         "it holds no facts about")  # fmt: skip
    lost = [f"run-{k}" for k in done if not (path / "raw" / f"run-{k}").is_dir()]
    if lost:
        raise SweepError(f"{path} lacks the records of {', '.join(lost)} (raw/{lost[0]})")
    collected = read_collected(path / "raw" / "collected.json")
    if collected is None:
        raise SweepError(f"{path} holds no collection (raw/collected.json)")
    return ShardDir(path, shard, state, collected)


def check_shards(paths: Sequence[Path]) -> list[ShardDir]:
    """The shards of one sweep, by index: same options but the shard, same collection,
    each of 1..N exactly once. SweepError naming the first thing that does not fit."""
    shards = [read_shard(p) for p in paths]
    first = shards[0]
    for other in shards[1:]:
        differ = [k for k, v in first.identity.items() if other.identity.get(k) != v]
        differ += [k for k in other.identity if k not in first.identity]
        if differ:
            name = differ[0]
            raise SweepError(
                f"{other.path} is not a shard of the sweep in {first.path}: {name} is "
                f"{other.identity.get(name)!r} there but {first.identity.get(name)!r}; shards "
                "of one sweep share every option but --shard"
            )
        if other.shard.count != first.shard.count:
            raise SweepError(f"{other.path} is shard {other.shard} but {first.path} is shard "
                             f"{first.shard}: shards of one sweep have one N")  # fmt: skip
        if other.collected != first.collected:
            raise SweepError(f"{other.path} collected other tests than {first.path} (did the "
                             "suite change between shards?)")  # fmt: skip
    by_index: dict[int, ShardDir] = {}
    for found in shards:
        if found.shard.index in by_index:
            raise SweepError(f"shard {found.shard} given twice: {by_index[found.shard.index].path}"
                             f" and {found.path}")  # fmt: skip
        by_index[found.shard.index] = found
    count = first.shard.count
    missing = [f"{k}/{count}" for k in range(1, count + 1) if k not in by_index]
    if missing:
        raise SweepError(f"shard {', '.join(missing)} missing (given: "
                         f"{', '.join(str(s.shard) for s in shards)})")  # fmt: skip
    return [by_index[k] for k in sorted(by_index)]


def merged_options(
    first: ShardDir,
    out: Path,
    *,
    budget: float | None,
    baseline: frozenset[str],
    progress: bool,
    junitxml: Path | None = None,
) -> SweepOptions:
    """The options of the sweep the shards make up: theirs, without the shard."""
    names = {f.name for f in dataclasses.fields(SweepOptions)}
    given: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                             for k, v in first.identity.items() if k in names}  # fmt: skip
    given["paths"] = tuple(Path(p) for p in first.identity["paths"])
    return SweepOptions(
        **given, out=out, budget=budget, baseline=baseline, progress=progress,
        invoked_from=Path(first.state["invoked_from"]), junitxml=junitxml,
    )  # fmt: skip


class MergedSweep(Sweep):
    """A sweep whose collection and runs (and some alone reruns) come from its shards."""

    def __init__(self, options: SweepOptions, shards: Sequence[ShardDir], *, no_run: bool):
        super().__init__(options)
        self.shards = list(shards)
        self.no_run = no_run
        if no_run:
            self.no_searches = NOT_RUN

    def phases(self) -> list[tuple[str, Callable[[], None]]]:
        loaded = [("collection", self._load_collection), ("runs", self._load_shards)]
        if self.no_run:
            return loaded
        return [*loaded, *[(n, p) for n, p in super().phases() if n not in ("collection", "runs")]]

    def _load_collection(self) -> None:
        first = self.shards[0]
        self.runner.pin(first.collected)
        for name in ("collected.json", "collect.log"):
            if (first.path / "raw" / name).is_file():
                shutil.copy2(first.path / "raw" / name, self.raw / name)
        self.suite_runs.take_collection(first.collected)

    def _load_shards(self) -> None:
        """Every shard's records into OUT/raw, then its runs (in run order, as one sweep
        ran them) and its processes' rows, counting the alone reruns that count."""
        for found in self.shards:
            copy_evidence(found.path / "raw", self.raw)
        owner = {int(k): found for found in self.shards for k in found.state["runs_done"]}
        for k in sorted(owner):
            self.suite_runs.load_run(k, owner[k].state["processes"])
        for found in self.shards:
            facts = found.state["processes"]
            counted = {str(label): (str(n), int(r)) for n, r, label in found.state["alone"]}
            for label in facts:
                if label.startswith("run-"):
                    continue
                result = self.suite_runs.reload(label, facts)
                self.store.take(result)
                if label in counted:
                    nodeid, rerun = counted[label]
                    attempts = {a.nodeid: a for (run, _), a in result.attempts().items()
                                if run == label}  # fmt: skip
                    failed, signals = target_outcome(attempts.get(nodeid), result.returncode)
                    self.isolation.count_alone(nodeid, rerun, failed, signals, label)
        self.store.note(
            f"merged from {len(self.shards)} shards: "
            + ", ".join(f"{s.shard} ({s.path})" for s in self.shards)
        )


def copy_evidence(source: Path, raw: Path) -> None:
    """A shard's raw/ into the merge's: records and logs under their run ids."""
    try:
        for entry in sorted(source.iterdir()) if source.is_dir() else []:
            if entry.name in LOCAL:
                continue
            target = raw / entry.name
            if entry.is_dir():
                shutil.copytree(entry, target, dirs_exist_ok=entry.name == "replays")
            elif not target.exists():
                shutil.copy2(entry, target)
    except OSError as exc:
        raise SweepError(f"cannot copy {source} into {raw}: {describe_error(exc)}") from None


def run_merge(
    out: Path,
    dirs: Sequence[Path],
    *,
    no_run: bool = False,
    force: bool = False,
    budget: float | None = None,
    baseline: frozenset[str] = frozenset(),
    progress: bool = True,
    junitxml: Path | None = None,
) -> SweepResult:
    """Merge the shards in `dirs` into one sweep in `out`; SweepError for bad input."""
    shards = check_shards([Path(d).resolve() for d in dirs])
    out = out.resolve()
    for found in shards:
        if out == found.path or found.path in out.parents or out in found.path.parents:
            raise SweepError(f"OUT {out} overlaps the shard in {found.path}: give another OUT")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise SweepError(f"OUT {out} is not empty: --force to replace the sweep there, "
                         "or another OUT")  # fmt: skip
    prepare_out(out, force=force)
    options = merged_options(shards[0], out, budget=budget, baseline=baseline,
                             progress=progress, junitxml=junitxml)  # fmt: skip
    return MergedSweep(options, shards, no_run=no_run).execute()
