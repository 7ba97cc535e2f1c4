"""A conversion table filled on demand: the state the brittle test relies on."""

FACTORS: dict[str, float] = {}


def load_metric() -> None:
    FACTORS.update({"m": 1.0, "km": 1000.0})
