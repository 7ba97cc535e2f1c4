"""The suite's configuration, frozen on first read by capsafe's FrozenConfig."""

from capsafe.config import FrozenConfig

PRECISION = FrozenConfig(
    "planted-precision",
    ["PLANTED_PRECISION"],
    lambda env: env["PLANTED_PRECISION"] or "fp32",
)
