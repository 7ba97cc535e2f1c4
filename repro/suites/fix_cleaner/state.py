"""A mode kept in a module global, changed only through functions: no assignment in a test
shows what to restore, but a test that resets it does (a cleaner)."""

MODE = "default"


def configure(mode: str) -> None:
    global MODE
    MODE = mode


def reset() -> None:
    configure("default")
