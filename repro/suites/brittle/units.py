"""A lazily filled conversion table: the state a brittle test depends on."""

FACTORS: dict[str, float] = {}


def load_metric() -> None:
    FACTORS.update({"km": 1000.0, "m": 1.0, "cm": 0.01})
