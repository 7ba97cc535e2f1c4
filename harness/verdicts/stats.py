"""Flake rates with honest error bars.

Three failures in five runs is not "60 %": it is anything from about 23 % to
88 %. The Wilson score interval says so, and unlike the textbook normal
interval it stays inside [0, 1] and is not degenerate at 0 or n failures,
which is exactly where a nightly sweep's counts live.
"""

from __future__ import annotations

import math

Z_95 = 1.959963984540054  # two-sided 95 %: the 0.975 quantile of the standard normal


def flake_rate(failures: int, runs: int) -> float:
    """Failures per run; 0.0 when the test never ran."""
    _check(failures, runs)
    return failures / runs if runs else 0.0


def wilson_interval(failures: int, runs: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval for a failure probability; (0, 1) when there were no runs."""
    _check(failures, runs)
    if runs == 0:
        return (0.0, 1.0)
    p = failures / runs
    z2 = z * z
    denominator = 1.0 + z2 / runs
    centre = (p + z2 / (2 * runs)) / denominator
    half = z * math.sqrt(p * (1.0 - p) / runs + z2 / (4 * runs * runs)) / denominator
    # Clamp the rounding dust so 0/n starts at exactly 0 and n/n ends at exactly 1.
    low = 0.0 if failures == 0 else max(0.0, centre - half)
    high = 1.0 if failures == runs else min(1.0, centre + half)
    return (low, high)


def _check(failures: int, runs: int) -> None:
    if runs < 0 or failures < 0 or failures > runs:
        raise ValueError(f"need 0 <= failures <= runs, got {failures} of {runs}")
