"""A test repeated in a replay list runs as a test of a module of its own, every time.

The sweep's pair runs and timing replays list one test several times in a row
(`T T T ...`). pytest tears down after an item only what the next item does not share,
and the next item is the same one, so left alone it would set the test up once (its
fixtures, `setup_function`, `setup_module`), run its body n times, and tear it down once,
at the end. In a shuffled suite run, though, a test's neighbours are mostly of other
modules, so each time it ran it set its module up and tore it down: python-fs's
collisions are one test's `teardown_module` removing the directory another worker's
`setup_function` is making, which a repetition that never tears down never repeats
(issue 21: 14 of 46 partners named). So between two repetitions of one test everything
below its module's parent is torn down (the module's teardown, class and function
fixtures), and the next repetition sets it up again; the session, and any package or
directory above the module, stay set up as they would for a neighbour of the same package.
"""

from __future__ import annotations

from typing import cast

import pytest

__all__ = ["tear_down_repetition"]


def tear_down_repetition(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """When `nextitem` is `item` again, tear down its module and everything under it, so
    the repetition sets them up anew (pytest's own teardown then has nothing left to do)."""
    if nextitem is not item:
        return
    module = item.getparent(pytest.Module)
    above = (module or item).parent
    if above is None:
        return
    # teardown_exact keeps what its argument's chain shares with the stack; it reads
    # only the argument's listchain(), which a collector has as an item does.
    item.session._setupstate.teardown_exact(cast(pytest.Item, above))
