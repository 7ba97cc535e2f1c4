"""Every command block of README.md and docs/*.md runs as written, or says what it needs.

A fenced block's info string says how it is checked:

- "```sh runnable" / "```python runnable" (optionally "exit=N" when the documented exit
  code is not 0): run in a fresh copy of the checkout, from its root, the way a new user
  pastes it into a clone (shell blocks with bash -euo pipefail, Python blocks with this
  interpreter). "needs=network" runs it only when PyPI answers, "needs=gpu" only with an
  NVIDIA GPU. A "```text output" block right after it lists lines its output (stdout and
  stderr) must have, in that order: whole lines, numbers compared as N, `...` for any text.
- "```sh ci": the commands `.ci/run` runs; each line must be one of its lines.
- "```crontab": each line's command runs with `cd DIR` pointing at an empty project and a
  stand-in `capsafe` on PATH (the plumbing around the sweep: directories, redirections).
- "```sh needs=REASON" / "```python needs=REASON" without runnable: a command the test
  machine cannot run; REASON is one of NEEDS.
- "```text", "```yaml", "```toml": output, layouts, synopses with placeholders, files.

A fast test checks that every block says one of these, so a new command cannot go unchecked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from wheel_build import pypi_reason

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)(.*)$")
COMMANDS = ("sh", "python")
NOT_COMMANDS = ("text", "yaml", "toml")
NEEDS = {
    "gpu": "an NVIDIA GPU and driver (benchmarks/run_gpu.sh runs the GPU commands on the H200)",
    "network": "PyPI, to install packages",
    "ci-matrix": "several CI jobs, one per shard, and one after them",
    "time": "longer than the docs test's watchdog (the mutation runs take up to an hour)",
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    flags: tuple[str, ...]
    code: str
    expected: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runnable(self) -> bool:
        return "runnable" in self.flags

    @property
    def exit_code(self) -> int:
        return next((int(f[5:]) for f in self.flags if f.startswith("exit=")), 0)

    @property
    def needs(self) -> str | None:
        return next((f[6:] for f in self.flags if f.startswith("needs=")), None)


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the output block after it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    fences: list[tuple[int, str, tuple[str, ...], list[str]]] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        fences.append((start + 1, opened.group(1), tuple(opened.group(2).split()), body))
        i += 1
    found = []
    for n, (line, language, flags, body) in enumerate(fences):
        expected: tuple[str, ...] = ()
        if n + 1 < len(fences) and fences[n + 1][1:3] == ("text", ("output",)):
            expected = tuple(text for text in fences[n + 1][3] if text.strip())
        found.append(Block(path, line, language, flags, "\n".join(body) + "\n", expected))
    return found


ALL = [block for path in DOCS for block in blocks(path)]
RUNNABLE = [block for block in ALL if block.runnable]


def how_checked(block: Block) -> str | None:
    """How the docs test checks `block`; None when its info string says nothing it knows."""
    if block.language in COMMANDS:
        if block.runnable:
            return "run"
        if block.language == "sh" and block.flags == ("ci",):
            return "ci"
        if block.needs in NEEDS:
            return f"needs {NEEDS[block.needs]}"
        return None
    if block.language == "crontab":
        return "crontab"
    if block.language in NOT_COMMANDS and not block.runnable:
        return "not a command"
    return None


def test_the_docs_have_runnable_blocks() -> None:
    assert any(block.path.name == "README.md" for block in RUNNABLE)


def test_every_block_says_how_it_is_checked() -> None:
    unknown = [f"{b.id}: ```{b.language} {' '.join(b.flags)}" for b in ALL if not how_checked(b)]
    assert not unknown, "blocks the docs test neither runs nor excuses:\n" + "\n".join(unknown)


def test_ci_blocks_are_what_ci_runs() -> None:
    """Each line is in a line of .ci/run (which may add options: coverage, a step label)."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for block in ALL:
        if how_checked(block) == "ci":
            lines = filter(str.strip, block.code.splitlines())
            missing = [line for line in lines if not any(line.strip() in c for c in ci)]
            assert not missing, f"{block.id}: .ci/run does not run {missing}"


def _matches(expected: tuple[str, ...], output: str) -> list[str]:
    """The expected lines not found, in order, among the output's lines."""

    def pattern(line: str) -> re.Pattern[str]:
        parts = [re.escape(p) for p in _numbers_as_n(line).split("...")]
        return re.compile(r"(^|.*\s)" + ".*".join(parts) + r"$")

    seen = [_numbers_as_n(line) for line in output.splitlines()]  # \r too: progress bars
    missing, at = [], 0
    for line in expected:
        wanted = pattern(line)
        hit = next((i for i in range(at, len(seen)) if wanted.match(seen[i])), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def _numbers_as_n(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", " ".join(text.split()))


def test_expected_output_is_whole_lines_in_order() -> None:
    output = (
        "x\r  order-dependent  a.py::t  after b.py::u\n"
        "capsafe sweep: 1 not passing; report: /tmp/r/report.html\n"
    )
    assert _matches(("order-dependent a.py::t after b.py::u",), output) == []
    assert _matches(("capsafe sweep: 2 not passing; report: .../r/report.html",), output) == []
    assert _matches(("order-dependent",), output) == ["order-dependent"]  # a line, not a word
    assert _matches(("capsafe sweep: ...", "order-dependent ..."), output) == [
        "order-dependent ..."
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPSAFE_", "PYTEST_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_crontab_lines_run_in_an_empty_project(tmp_path: Path) -> None:
    """The nightly line failed on its first night: `>> reports/nightly.log` in a project
    without reports/ (the shell opens the log before the sweep can make the directory)."""
    stub = tmp_path / "bin" / "capsafe"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "stand-in capsafe $*"\nexit 1\n')
    stub.chmod(0o755)
    crontabs = [b for b in ALL if b.language == "crontab"]
    assert crontabs
    for block in crontabs:
        for line in filter(str.strip, block.code.splitlines()):
            project = tmp_path / f"project-{block.line}"
            project.mkdir()
            command = line.split(None, 5)[5]  # after minute, hour, day, month, weekday
            command = re.sub(r"^cd \S+", f"cd {project}", command)
            env = {**_env(), "PATH": f"{stub.parent}{os.pathsep}{_env()['PATH']}"}
            done = subprocess.run(["/bin/sh", "-c", command], env=env, capture_output=True,
                                  text=True, timeout=60)  # fmt: skip
            assert "No such file" not in done.stderr, f"{block.id}: {done.stderr}"
            logs = [p.read_text() for p in project.rglob("*.log")]
            assert any("stand-in capsafe sweep" in text for text in logs), f"{block.id}: {logs}"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tracked and untracked-but-not-ignored files, as a fresh clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    copy = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def _skip_reason(block: Block) -> str | None:
    if block.needs == "network":
        return pypi_reason()
    if block.needs == "gpu":
        from capsafe import backend_cuda

        return backend_cuda.unavailable_reason()
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_block_runs_as_written(block: Block, checkout: Path) -> None:
    if reason := _skip_reason(block):
        pytest.skip(f"{block.id} needs {NEEDS[block.needs or '']}: {reason}")
    if block.language == "sh":
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        command = [sys.executable, "-c", block.code]
    env = _env()
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, timeout=570
    )
    output = done.stdout + done.stderr
    assert done.returncode == block.exit_code, f"{block.id} exited {done.returncode}:\n{output}"
    missing = _matches(block.expected, output)
    assert not missing, f"{block.id}: output lacks {missing}:\n{output}"
