"""One directory every xdist worker shares, as python-fs's tests share `fs/tests/test_dir`:
one module's `setup_function` makes it and writes into it, another's `teardown_module`
removes it. Beside each other they collide; alone, or one after the other, they pass.

In the suite runs (xdist workers) the two meet (side.py), so that the removal falls
between the making and the writing whatever the load: the collision is planted, not left
to chance. Anywhere else (alone, a sequence replay, a pair run the sweep starts) nobody
waits: whether they collide is up to timing, as in python-fs, and the making takes
SLOW_S (a slow disk), so a removal that runs while it does hits it.
"""

import os
import shutil
import time

from side import meet, shared_dir

SLOW_S = 0.05


def test_dir():
    return os.path.join(shared_dir(), "test_dir")


def in_suite_run():
    return "PYTEST_XDIST_WORKER" in os.environ


def make():
    """python-fs's setup_function: the directory, then a file in it."""
    os.makedirs(test_dir(), exist_ok=True)
    if in_suite_run():
        meet("made")  # the other worker's removal (or its end) comes next
        meet("removed")
    else:
        time.sleep(SLOW_S)
    with open(os.path.join(test_dir(), "index.txt"), "w") as f:
        f.write("index")


def remove():
    """python-fs's teardown_module: the directory, whatever is in it."""
    if in_suite_run():
        meet("made")
    shutil.rmtree(test_dir(), ignore_errors=True)
    if in_suite_run():
        meet("removed")
