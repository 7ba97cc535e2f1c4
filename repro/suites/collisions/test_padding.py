import pytest


@pytest.mark.parametrize("n", range(8))
def test_square(n):
    assert n * n >= 0
