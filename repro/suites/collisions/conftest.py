import pytest
import side


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports its collection
def pytest_collection_finish(session):
    side.register(session.config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A replay forked from a collected pytest learns its run id after collection: it
    # registers before its first test, whether or not that test meets anyone.
    side.register_once(item.config)


def pytest_sessionfinish(session):
    side.ended()
