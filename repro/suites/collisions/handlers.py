"""A module-level handler table: the shared state the polluter leaves behind."""

HANDLERS: list[str] = []


def add(name: str) -> None:
    HANDLERS.append(name)
