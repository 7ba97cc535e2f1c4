"""Every fenced block of README.md and docs/*.md marked runnable runs as written.

A block opens with "```sh runnable" or "```python runnable" (optionally
"exit=N" when the command's documented exit code is not 0). Shell blocks run
with bash -euo pipefail in a fresh copy of the checkout, from its root, the
way a new user pastes them into a clone; Python blocks run with this
interpreter in the same copy. A "```text output" block right after a runnable
block lists lines its output must contain (numbers compared as N).
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

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)(.*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    exit_code: int
    expected: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def runnable_blocks(path: Path) -> list[Block]:
    """The runnable blocks of one Markdown file, each with the output block after it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    fences: list[tuple[int, str, str, list[str]]] = []
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
        fences.append((start + 1, opened.group(1), opened.group(2).strip(), body))
        i += 1
    blocks = []
    for n, (line, language, words, body) in enumerate(fences):
        flags = words.split()
        if "runnable" not in flags:
            continue
        exit_code = next((int(f[5:]) for f in flags if f.startswith("exit=")), 0)
        expected: tuple[str, ...] = ()
        if n + 1 < len(fences) and fences[n + 1][2].split()[:1] == ["output"]:
            expected = tuple(text for text in fences[n + 1][3] if text.strip())
        blocks.append(Block(path, line, language, "\n".join(body) + "\n", exit_code, expected))
    return blocks


BLOCKS = [block for path in DOCS for block in runnable_blocks(path)]


def _numbers_as_n(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", " ".join(text.split()))


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


def test_the_docs_have_runnable_blocks() -> None:
    assert any(block.path.name == "README.md" for block in BLOCKS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_block_runs_as_written(block: Block, checkout: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPSAFE_", "PYTEST_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if block.language in ("sh", "bash", "console"):
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    elif block.language == "python":
        command = [sys.executable, "-c", block.code]
    else:
        pytest.fail(f"{block.id}: runnable block in unknown language {block.language!r}")
    done = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, timeout=570
    )
    output = done.stdout + done.stderr
    assert done.returncode == block.exit_code, f"{block.id} exited {done.returncode}:\n{output}"
    seen = _numbers_as_n(output)
    missing = [line for line in block.expected if _numbers_as_n(line) not in seen]
    assert not missing, f"{block.id}: output lacks {missing}:\n{output}"
