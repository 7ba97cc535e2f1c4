"""Tests that touch no decimal state."""

import pytest


@pytest.mark.parametrize("n", range(10))
def test_square(n):
    assert n * n >= 0
