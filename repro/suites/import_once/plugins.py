"""A plugin directory every xdist worker shares, as python-fs's tests share `fs/tests/test_dir`.

test_loader.py writes a module into it and imports it from there (python-fs's
`test_addpath`); test_sweeper.py clears it, as a cache cleaner would. Beside each other
they collide; alone, or one after the other, they pass.

In the suite runs (xdist workers) the two meet (side.py), so that the clearing falls
between the writing and the importing whatever the load: the collision is planted. In
a pair run the sweep starts nobody waits: the cleaner clears the directory every
SWEEP_EVERY_S for SWEEP_S, and the loader's import comes WINDOW_S after its write, so
a repetition of the loader beside it collides about half the time, and its one run in
a process (it cannot run twice there) seldom three pair runs of three.
"""

import os
import shutil
import time

from side import meet, shared_dir

MODULE = "planted_plugin"
WINDOW_S = 0.005  # from writing the module to importing it, outside the suite runs
SWEEP_S = 0.25  # how long the cleaner keeps clearing, outside the suite runs
SWEEP_EVERY_S = 0.01


def plugin_dir():
    return os.path.join(shared_dir(), "plugins")


def in_suite_run():
    return "PYTEST_XDIST_WORKER" in os.environ


def write():
    """The module, in the shared directory (made if missing); the directory."""
    directory = plugin_dir()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, MODULE + ".py"), "w") as f:
        f.write('NAME = "planted"\n')
    return directory


def before_import():
    """Between the write and the import: the cleaner's turn."""
    if in_suite_run():
        meet("written")  # the other worker's clearing (or its end) comes next
        meet("cleared")
    else:
        time.sleep(WINDOW_S)


def clear():
    """The cleaner: the directory, whatever is in it."""
    if in_suite_run():
        meet("written")
        shutil.rmtree(plugin_dir(), ignore_errors=True)
        meet("cleared")
        return
    until = time.monotonic() + SWEEP_S
    while time.monotonic() < until:
        shutil.rmtree(plugin_dir(), ignore_errors=True)
        time.sleep(SWEEP_EVERY_S)
