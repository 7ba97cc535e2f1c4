"""`capsafe sweep` on six real projects with published order-dependent and brittle tests.

Each case of ../shared/realworld/cases.json (or $CAPSAFE_REALWORLD) is unpacked from
its archive, given a venv built from PyPI (pytest, pytest-xdist, pytest-timeout, its
requirements and this checkout's wheel), and swept from the archive's root with the
case's paths and pytest arguments. Every victim of its key must get its class and a
right cause (any of `other_polluters`, and for victims needing several polluters,
any polluter interchangeable with a keyed one); a cause named for a test outside
the key is checked the way the key was: `[cause, test]` fails, `test` alone passes.

Marked `realworld` (run by .ci/run on their own); skipped when PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import venv
from pathlib import Path
from typing import Any

import pytest
from wheel_build import build_wheel, pypi_reason

pytestmark = [pytest.mark.realworld, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CAPSAFE_REALWORLD", ROOT.parent / "shared" / "realworld"))
TOOLS = ("pytest", "pytest-xdist", "pytest-timeout")
SWEEP = {  # per case: modest runs and workers, so all six fit in a few minutes on 2 cores
    "freezegun": ["--runs", "6", "--workers", "2", "--seed", "1"],
    "configaro": ["--runs", "4", "--workers", "2", "--seed", "1"],
    "colltools": ["--runs", "4", "--workers", "2", "--seed", "1"],
    "PyJsonFriendly": ["--runs", "8", "--workers", "2", "--seed", "1"],
    "NestedDictionary": ["--runs", "4", "--workers", "2", "--seed", "1"],
    "envyaml": ["--runs", "4", "--workers", "2", "--seed", "1"],
}


def _cases() -> list[dict[str, Any]]:
    path = SHARED / "cases.json"
    return json.loads(path.read_text()) if path.is_file() else []


def _run(command: list[str], cwd: Path, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPSAFE_", "PYTEST_"))}
    for name in ("VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(name, None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (SHARED / "cases.json").is_file():
        pytest.skip(f"no real-world cases at {SHARED} (set CAPSAFE_REALWORLD)")
    reason = pypi_reason()
    if reason:
        pytest.skip(reason)
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def interchangeable(case: dict[str, Any]) -> dict[str, set[str]]:
    """Polluters the key says are equivalent: a keyed polluter and its other_polluters."""
    same: dict[str, set[str]] = {}
    for victim, entry in case.get("key", {}).items():
        group = {entry.get("polluter", ""), *case.get("other_polluters", {}).get(victim, [])}
        for polluter in group - {""}:
            same.setdefault(polluter, {polluter}).update(group - {""})
    return same


def allowed_causes(case: dict[str, Any], victim: str) -> set[str]:
    same = interchangeable(case)
    if victim in case.get("key", {}):
        entry = case["key"][victim]
        named = {entry.get("polluter") or entry.get("state_setter")}
        named |= set(case.get("other_polluters", {}).get(victim, []))
    else:
        named = set(case["key_multi"][victim]["polluters"])
    return {alt for n in named for alt in same.get(n, {n})}


def reproduces(
    python: Path, root: Path, cause: list[str], victim: str, tmp: Path, args: list[str]
) -> bool:
    """The key's own check: `[cause, victim]` fails and `victim` alone passes."""

    def failed(sequence: list[str]) -> bool:
        replay = tmp / f"replay-{len(list(tmp.glob('replay-*')))}.txt"
        replay.write_text("".join(f"{n}\n" for n in sequence))
        done = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                     "-p", "no:xdist", f"--capsafe-replay={replay}", *args,
                     *sorted({n.split("::")[0] for n in sequence})], cwd=root)  # fmt: skip
        return done.returncode != 0

    return failed([*cause, victim]) and not failed([victim])


@pytest.mark.parametrize("case", _cases(), ids=[c["name"] for c in _cases()])
def test_the_sweep_classifies_the_case_as_its_key_says(
    case: dict[str, Any], wheel: Path, tmp_path: Path
) -> None:
    with tarfile.open(SHARED / case["archive"]) as archive:
        archive.extractall(tmp_path / "src", filter="data")
    root = tmp_path / "src"  # a `git archive`: the repository's files at the top
    venv.create(tmp_path / "env", with_pip=True)
    python = tmp_path / "env" / "bin" / "python"
    pip = _run([str(python), "-m", "pip", "install", "-q", *TOOLS, *case["requirements"],
                f"{wheel}[harness]"], cwd=tmp_path)  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    out = tmp_path / "report"
    done = _run([str(python), "-m", "capsafe.cli", "sweep", "--no-progress", *case["paths"],
                 "--out", str(out), "--timeout", "30", *SWEEP[case["name"]],
                 "--", *case.get("pytest_args", [])], cwd=root)  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    tests = {t["nodeid"]: t for t in json.loads((out / "summary.json").read_text())["tests"]}
    victims = {**case.get("key", {}), **case.get("key_multi", {})}
    wrong, missed = [], []
    for victim, entry in victims.items():
        got = tests.get(victim)
        if (
            got is not None
            and got["classification"] in ("pass", "flaky")
            and not (got["polluters"] or got["state_setters"])
        ):
            missed.append(f"{victim}: {got['classification']} {got['why']}")
            continue
        if got is None or got["classification"] != entry["class"]:
            wrong.append(f"{victim}: {got and got['classification']} {got and got['why']}")
            continue
        named = got["polluters"] or got["state_setters"]
        if not named or not set(named) <= allowed_causes(case, victim):
            wrong.append(
                f"{victim}: cause {named}, key allows {sorted(allowed_causes(case, victim))}"
            )
    assert not wrong, "\n".join(wrong) + "\n" + done.stderr
    assert not missed, "\n".join(missed)
    for nodeid, test in tests.items():
        if nodeid in victims or not test["polluters"]:
            continue
        cause = test["polluters"]
        args = case.get("pytest_args", [])
        assert reproduces(python, root, cause, nodeid, tmp_path, args), (nodeid, test)
