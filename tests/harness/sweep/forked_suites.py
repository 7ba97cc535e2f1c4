"""Planted suites for the fork-server tests: a suite from its files, and a test that does
something only in a child of the fork server (what a fresh process never does)."""

from __future__ import annotations

from pathlib import Path


def write_suite(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def when_forked(name: str, action: str) -> str:
    """A module with test `name`, which runs `action` (one line) only in a forked child:
    the process whose parent's command line is the fork server's (needs /proc)."""
    return (
        "import os, signal\n"
        f"def {name}():\n"
        "    with open(f'/proc/{os.getppid()}/cmdline', 'rb') as parent:\n"
        "        if b'sweep.fork_server' in parent.read():  # a child of the fork server\n"
        f"            {action}\n"
    )


CRASHES_WHEN_FORKED = when_forked(
    "test_crashes_only_forked", "os.kill(os.getpid(), signal.SIGSEGV)"
)
