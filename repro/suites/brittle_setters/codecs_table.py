"""A lazily filled table: twenty tests fill it, one brittle test only reads it."""

TABLE: dict[str, str] = {}


def ensure_loaded() -> None:
    TABLE.setdefault("utf8", "UTF-8")
    TABLE.setdefault("latin1", "ISO-8859-1")
