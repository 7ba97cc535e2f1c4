import os


def test_enable_fast_mode():
    # The polluter: sets an environment variable and never restores it.
    os.environ["FIX_SUITE_MODE"] = "fast"
    assert os.environ["FIX_SUITE_MODE"] == "fast"
