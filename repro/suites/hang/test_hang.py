import time


def test_waits_forever():
    # Hangs far beyond any sweep timeout: pytest-timeout must end it.
    time.sleep(3600)
