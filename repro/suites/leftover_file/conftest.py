import pytest


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory):
    """One export directory per test process, shared by every test in it."""
    return tmp_path_factory.mktemp("exports")
