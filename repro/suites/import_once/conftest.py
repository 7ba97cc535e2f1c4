import os
import sys

import pytest

# The rendezvous of the planted collisions suite, for the suite runs' xdist workers only:
# in the sweep's pair runs nobody waits, timing alone decides (as in python-fs).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "collisions"))
import side  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports its collection
def pytest_collection_finish(session):
    if "PYTEST_XDIST_WORKER" in os.environ:
        side.register(session.config)


def pytest_sessionfinish(session):
    side.ended()
