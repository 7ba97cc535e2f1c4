import pytest


@pytest.mark.parametrize("n", range(4))
def test_square(n):
    assert n * n >= 0
