"""The signal-point checker (cases/signal_points.py) over every capture cycle capsafe offers.

One exception at each place CPython can deliver a signal, in one capture
begin/end cycle through the facade, through each integration's hooks and
`capture()` block (over the fakes their tests use), and in one gated call; after
each, the gate must be usable and nothing held. Reintroducing issue 22's items
1, 2 or 6 makes this fail (checked by hand when they were fixed; see docs/gate.md).
"""

from __future__ import annotations

import pytest
from signal_points import CYCLES, Cycle, check

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("cycle", CYCLES, ids=[c.name for c in CYCLES])
def test_no_signal_point_leaves_the_gate_unusable(cycle: Cycle) -> None:
    report = check(cycle)
    print(f"{cycle.name}: {report.points} points checked, {len(report.bad)} bad")
    assert report.points > 10, "the tracer saw too little of the cycle to mean anything"
    assert not report.bad, "\n".join(f"{point}: {'; '.join(why)}" for point, why in report.bad)
