"""`capsafe sweep`'s entry: prepare --out, then run the phases of one sweep to its result."""

from __future__ import annotations

from .options import SweepOptions
from .phases import Sweep, SweepResult
from .state import prepare_out


def run_sweep(options: SweepOptions) -> SweepResult:
    """Run one whole sweep and write its reports into options.out."""
    prepare_out(options.out, resume=options.resume, force=options.force)
    return Sweep(options).execute()
