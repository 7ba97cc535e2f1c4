import pytest


@pytest.mark.parametrize("n", range(6))
def test_square(n):
    assert n * n >= 0
