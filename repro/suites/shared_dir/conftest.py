import os
import sys

import pytest

# The rendezvous of the planted collisions suite: who runs beside this process.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "collisions"))
import side  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports its collection
def pytest_collection_finish(session):
    side.register(session.config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    side.register_once(item.config)


def pytest_sessionfinish(session):
    side.ended()
