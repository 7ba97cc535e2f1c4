import os


def test_coin_flip():
    # Truly nondeterministic (os.urandom, not the reseeded `random`): fails about half the time.
    assert os.urandom(1)[0] < 128
