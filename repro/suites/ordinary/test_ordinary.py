import pytest


@pytest.mark.parametrize("n", range(200))
def test_int_roundtrip(n):
    assert int(str(n)) == n


@pytest.mark.parametrize("word", [f"w{i}" for i in range(100)])
def test_str_upper_lower(word):
    assert word.upper().lower() == word
