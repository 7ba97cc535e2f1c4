import os


def test_mode_defaults_to_safe():
    # The victim: passes alone, fails after test_enable_fast_mode in the same process.
    assert os.environ.get("FIX_SUITE_MODE", "safe") == "safe"
