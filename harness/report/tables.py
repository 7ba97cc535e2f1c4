"""The sweep's tables as pandas operations: per-test outcomes from records, tests.csv, history.

One place for pandas: the report and the history call these, the test processes
never do (the plugin imports neither this module nor pandas; an import contract
checks it). Every function takes and returns plain Python at its edges where a
caller only needs values, so pandas stays an implementation detail here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pandas as pd  # type: ignore[import-untyped]

from ..records import OUTCOMES, Outcome, Record
from ..verdicts import fold
from ..verdicts.catalogue import Verdict
from .summary import TestVerdict

ENV_LEAKS_SHOWN = 10  # distinct (variable, before, after) changes kept per test
TESTS_CSV_COLUMNS = (
    "nodeid", "classification", "outcome", "runs", "failures", "flake_rate", "ci_low", "ci_high",
    "isolation_runs", "isolation_failures", "polluters", "state_setters", "collides_with",
    "signals", "env_leaks", "message", "replay",
)  # fmt: skip
HISTORY_COLUMNS = (
    "suite", "sweep_id", "timestamp", "nodeid", "classification", "runs", "failures",
    "flake_rate", "first_seen", "last_seen",
)  # fmt: skip
_RECORD_COLUMNS = ("nodeid", "run_id", "phase", "outcome", "message", "details", "time", "env_leak")
_RANK = {outcome: rank for rank, outcome in enumerate(OUTCOMES)}


# ---------------------------------------------------------------- per test, from records


def outcomes_by_test(rows: Iterable[Record], ends: Iterable[fold.RunOutcome] = ()) -> pd.DataFrame:
    """Per test (index: node id) what its records say beyond the verdict.

    outcome: the worst outcome of any of its attempts (failed, xpassed, xfailed, skipped,
    passed); outcomes: {outcome: attempts}; message and details: the latest row with
    that outcome and a message (a failure, a skip or xfail reason); env_leaks: the
    distinct [variable, before, after] it left changed. `ends`: how the processes ended
    (a test its process died in failed, whatever its rows say).
    """
    said: list[dict[str, Any]] = []  # only rows with a message or a leak: one pass, never every row

    def kept(rows: Iterable[Record]) -> Iterator[Record]:
        for r in rows:
            row = said_row(r)
            if row is not None:
                said.append(row)
            yield r

    return outcomes_table(fold.attempt_outcomes(kept(rows), ends), said)


def said_row(row: Record) -> dict[str, Any] | None:
    """The columns `outcomes_table` reads of a row with a message or a leak; None otherwise."""
    if row.get("message") or row.get("env_leak"):
        return {k: row.get(k) for k in _RECORD_COLUMNS}
    return None


def worst_outcomes(folded: Mapping[str, Mapping[str, Outcome]]) -> dict[str, Outcome]:
    """Each test's worst outcome over its attempts (the table's `outcome`), from
    fold.attempt_outcomes' run -> test -> outcome."""
    return {n: OUTCOMES[_worst(c)] for n, c in _rank_counts(folded).items()}


def _worst(counts: Sequence[int]) -> int:
    return next(r for r, k in enumerate(counts) if k)


def _rank_counts(folded: Mapping[str, Mapping[str, Outcome]]) -> dict[str, list[int]]:
    ranks: dict[str, list[int]] = {}  # per test, attempts per outcome rank
    for per_run in folded.values():
        for nodeid, outcome in per_run.items():
            ranks.setdefault(nodeid, [0] * len(OUTCOMES))[_RANK[outcome]] += 1
    return ranks


def outcomes_table(
    folded: Mapping[str, Mapping[str, Outcome]], said_rows: Sequence[Mapping[str, Any]]
) -> pd.DataFrame:
    """`outcomes_by_test`'s frame from the attempts' outcomes (fold.attempt_outcomes) and
    the rows with a message or a leak (`said_row`)."""
    frame = pd.DataFrame.from_records(list(said_rows), columns=list(_RECORD_COLUMNS))
    columns = ["outcome", "outcomes", "message", "details", "env_leaks"]
    if not folded:
        return pd.DataFrame(columns=columns).rename_axis("nodeid")
    frame["rank"] = frame["outcome"].map(_RANK).fillna(len(OUTCOMES) - 1).astype(int)
    ranks = _rank_counts(folded)
    worst = pd.Series({n: _worst(c) for n, c in ranks.items()})
    outcomes = pd.Series(
        {n: {OUTCOMES[r]: k for r, k in enumerate(c) if k} for n, c in ranks.items()}, dtype=object
    )
    said = frame[
        (frame["message"].fillna("") != "") & (frame["rank"] == frame["nodeid"].map(worst))
    ]
    latest = said.sort_values("time").groupby("nodeid", sort=False).last()
    result = pd.DataFrame({"outcome": worst.map(dict(enumerate(OUTCOMES))), "outcomes": outcomes})
    result["message"] = latest["message"].reindex(result.index).fillna("")
    result["details"] = latest["details"].reindex(result.index).fillna("")
    result["env_leaks"] = _env_leaks(frame).reindex(result.index)
    result["env_leaks"] = result["env_leaks"].apply(lambda v: v if isinstance(v, list) else [])
    return result.rename_axis("nodeid")


def _env_leaks(frame: pd.DataFrame) -> pd.Series:
    leaked = frame[frame["env_leak"].apply(lambda v: isinstance(v, dict) and bool(v))]
    if leaked.empty:
        return pd.Series(dtype=object)
    pairs = leaked[["nodeid"]].assign(env_leak=leaked["env_leak"].map(lambda d: list(d.items())))
    pairs = pairs.explode("env_leak")
    pairs["variable"] = pairs["env_leak"].str[0]
    pairs["before"] = pairs["env_leak"].str[1].str[0]
    pairs["after"] = pairs["env_leak"].str[1].str[1]
    distinct = pairs.drop_duplicates(["nodeid", "variable", "before", "after"])
    distinct = distinct.sort_values("variable", kind="stable")
    leaks = distinct[["variable", "before", "after"]].values.tolist()
    per_test: dict[str, list[list[str | None]]] = {}
    for nodeid, leak in zip(distinct["nodeid"], leaks, strict=True):
        shown = per_test.setdefault(nodeid, [])
        if len(shown) < ENV_LEAKS_SHOWN:
            shown.append(leak)
    return pd.Series(per_test, dtype=object)


def per_test_table(tests: Sequence[TestVerdict], outcomes: pd.DataFrame) -> list[dict[str, Any]]:
    """The summary's tests, each with its record-derived outcome, message, details and leaks.

    The summary's own message (a collection error, or the sweep's chosen failure) wins
    over the records'; a test with no records (not collected) is `failed` if its class
    is not `pass`.
    """
    frame = pd.DataFrame.from_records([dict(vars(t)) for t in tests])  # no nested dataclass
    if frame.empty:
        return []
    joined = frame.join(outcomes.add_prefix("rec_"), on="nodeid")
    fallback = joined["classification"].map(lambda c: "passed" if c == Verdict.PASS else "failed")
    joined["outcome"] = joined["rec_outcome"].fillna(fallback)
    if "message" not in joined:
        joined["message"] = ""
    own = joined["message"].fillna("")
    joined["message"] = own.where(own != "", joined["rec_message"].fillna(""))
    joined["details"] = joined["rec_details"].fillna("")
    joined["details"] = joined["details"].where(joined["details"] != "", joined["message"])
    joined["env_leaks"] = joined["rec_env_leaks"].apply(lambda v: v if isinstance(v, list) else [])
    joined["outcomes"] = joined["rec_outcomes"].apply(lambda v: v if isinstance(v, dict) else {})
    joined = joined.drop(columns=[c for c in joined.columns if c.startswith("rec_")])
    return records(joined)


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The frame's rows as dicts of plain Python values, column by column: `to_dict`
    boxes each cell in a call of its own (310,000 calls, most of a 2,000-test sweep's
    report time)."""
    columns = [str(c) for c in frame.columns]
    values = [frame[c].astype(object).tolist() for c in frame.columns]
    return [dict(zip(columns, row, strict=True)) for row in zip(*values, strict=True)]


def env_leak_text(leak: Sequence[str | None]) -> str:
    """VAR: before -> after, `unset` for a variable that did not exist."""
    variable, before, after = leak
    return f"{variable}: {_shown(before)} -> {_shown(after)}"


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def write_tests_csv(path: str | os.PathLike[str], tests: Sequence[Mapping[str, Any]]) -> None:
    """One row per test (from `per_test_table`); lists joined with ';' so it stays one table."""
    frame = pd.DataFrame.from_records([dict(t) for t in tests])
    if frame.empty:
        pd.DataFrame(columns=list(TESTS_CSV_COLUMNS)).to_csv(path, index=False)
        return
    frame["ci_low"] = frame["flake_rate_ci"].str[0]
    frame["ci_high"] = frame["flake_rate_ci"].str[1]
    for column in ("polluters", "state_setters", "collides_with", "signals"):
        if column not in frame:  # a summary written before the field existed
            frame[column] = [[] for _ in range(len(frame))]
        frame[column] = frame[column].map(lambda v: ";".join(v) if isinstance(v, list) else "")
    frame["env_leaks"] = frame["env_leaks"].map(lambda leaks: ";".join(map(env_leak_text, leaks)))
    frame.reindex(columns=list(TESTS_CSV_COLUMNS)).to_csv(path, index=False)


# ---------------------------------------------------------------- history


def history_frame(rows: Iterable[Mapping[str, str]]) -> pd.DataFrame:
    """History rows as a frame with every column (a row of the older format: suite "")."""
    frame = pd.DataFrame.from_records([dict(r) for r in rows], columns=list(HISTORY_COLUMNS))
    return frame.astype(object).fillna("")


def new_history_rows(
    old: Iterable[Mapping[str, str]],
    suite: str,
    sweep_id: str,
    timestamp: str,
    verdicts: Iterable[Any],
) -> list[dict[str, str]]:
    """This sweep's rows; `first_seen`/`last_seen` carried forward from the suite's history.

    A verdict is anything with nodeid, classification, runs, failures, flake_rate.
    """
    past = history_frame(old)
    past = past[(past["suite"] == suite) & (past["first_seen"] != "")]
    seen = past.groupby("nodeid", sort=False)[["first_seen", "last_seen"]].last()
    frame = pd.DataFrame.from_records(
        [
            {
                "nodeid": v.nodeid,
                "classification": v.classification,
                "runs": str(v.runs),
                "failures": str(v.failures),
                "flake_rate": f"{v.flake_rate:.6g}",
            }
            for v in verdicts
        ],
        columns=["nodeid", "classification", "runs", "failures", "flake_rate"],
    )
    frame = frame.join(seen, on="nodeid")
    frame[["first_seen", "last_seen"]] = frame[["first_seen", "last_seen"]].fillna("")
    failing = frame["classification"] != Verdict.PASS.value
    frame.loc[failing & (frame["first_seen"] == ""), "first_seen"] = timestamp
    frame.loc[failing, "last_seen"] = timestamp
    frame = frame.assign(suite=suite, sweep_id=sweep_id, timestamp=timestamp)
    return [
        {k: str(v) for k, v in row.items()}
        for row in records(frame.reindex(columns=list(HISTORY_COLUMNS)))
    ]


def of_suite(history: Iterable[Mapping[str, str]], suite: str) -> list[dict[str, str]]:
    """The rows of one suite, in file order."""
    frame = history_frame(history)
    return records(frame[frame["suite"] == suite])


def trends(history: Iterable[Mapping[str, str]], limit: int = 20) -> dict[str, list[float]]:
    """Per test, its flake rate in each of the last `limit` sweeps, oldest first."""
    frame = history_frame(history)
    frame["rate"] = pd.to_numeric(frame["flake_rate"], errors="coerce")
    frame = frame.dropna(subset=["rate"])
    return {
        str(nodeid): rates.tail(limit).tolist()
        for nodeid, rates in frame.groupby("nodeid", sort=False)["rate"]
    }


def not_passing_per_sweep(history: Iterable[Mapping[str, str]], limit: int = 30) -> list[int]:
    """Tests not passing in each of the last `limit` sweeps, oldest first."""
    frame = history_frame(history)
    if frame.empty:
        return []
    passing = Verdict.PASS.value
    bad = (frame["classification"].replace("", passing) != passing).groupby(
        frame["sweep_id"], sort=False
    )
    return [int(n) for n in bad.sum().tail(limit).tolist()]
