import pytest


@pytest.mark.parametrize("n", range(6))
def test_cube(n):
    assert n**3 >= 0
