import os


def test_process_dies():
    # Kills its own process mid-test, the way a segfaulting extension would.
    os._exit(1)
