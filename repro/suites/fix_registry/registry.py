"""A module-level plugin registry: the shared state the polluter leaves behind."""

PLUGINS: list[str] = []


def register(name: str) -> None:
    PLUGINS.append(name)
